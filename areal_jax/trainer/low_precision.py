"""AdamW's moments stored in bfloat16 with stochastic rounding: ``train.moment_dtype=bfloat16``.

AdamW keeps two float32 moments of every trained parameter, 8 bytes, twice the float32 params themselves: 61 GB at
Qwen2.5-7B's 7.6B parameters, beside 30 GB of params, 30 GB of gradients and the sampler's 15 GB bfloat16 copy on
a colocated H200 of 141 GB. Stored in bfloat16 the moments take half.

Rounded to nearest, a bfloat16 second moment would stop working: each step changes it by (1 - b2) = 0.1% of the
difference to the gradient's square, below bfloat16's resolution (8 bits: a step of 0.4-0.8%), so a moment rounded
to nearest neither decays nor takes in gradients much smaller than it. Stochastic rounding rounds up with the
probability of the remainder, so each stored moment equals the float32 one in expectation, and the moments follow
their float32 averages. Each step computes in float32 from the stored moments (AdamW's step with its bias
correction); only what is stored is rounded.

The rounding's random bits hash each element's index with the step count and the leaf's number, inside the update's
fused elementwise program: no random-number state and no memory traffic of their own, and the same bits on every
run, so a restored run takes the same steps.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

MOMENT_DTYPES = ("float32", "bfloat16")


class LowPrecisionAdamState(NamedTuple):
    """count: int32 [] steps taken; mu, nu: the first and second moments, shaped like the params, in the
    storage dtype."""

    count: jax.Array
    mu: Any
    nu: Any


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit finaliser (xor-shift-multiply rounds): every input bit reaches every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def random_bits(shape: tuple[int, ...], step: jax.Array, salt: int) -> jax.Array:
    """uint32 bits of `shape`, a hash of each element's row-major index, `step` and `salt` (the leaf's number)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    seed = _mix(jnp.asarray(step).astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.uint32((salt * 0x85EBCA77 + 1)
                                                                                           % 2**32))
    return _mix(index * jnp.uint32(0xC2B2AE3D) + seed)


def stochastic_round(x: jax.Array, bits: jax.Array, dtype: Any = jnp.bfloat16) -> jax.Array:
    """float32 `x` rounded to bfloat16 away from zero with the probability of the dropped remainder (its low 16
    bits against the top 16 of `bits`), toward zero otherwise: unbiased, E[result] = x. Other storage dtypes
    (float32) take x as it is."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return x.astype(dtype)
    if dtype != jnp.bfloat16:
        raise ValueError(f"stochastic rounding stores float32 or bfloat16, not {dtype}.")
    u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    up = lax.bitcast_convert_type((u + (bits >> 16)) & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), up, x).astype(dtype)  # exact: the low 16 bits are zero


def scale_by_adam_stochastic(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                             moment_dtype: Any = jnp.bfloat16) -> optax.GradientTransformation:
    """optax.scale_by_adam's step (bias-corrected, computed in float32) with its moments stored in
    `moment_dtype` by `stochastic_round`."""
    moment_dtype = jnp.dtype(moment_dtype)

    def init(params: Any) -> LowPrecisionAdamState:
        def zeros(p: Any) -> jax.Array:
            return jnp.zeros(jnp.shape(p), moment_dtype)

        return LowPrecisionAdamState(jnp.zeros([], jnp.int32), jax.tree.map(zeros, params),
                                     jax.tree.map(zeros, params))

    def update(updates: Any, state: LowPrecisionAdamState, params: Any = None) -> tuple[Any, LowPrecisionAdamState]:
        del params
        count = optax.safe_increment(state.count)
        grads, treedef = jax.tree.flatten(updates)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        step = count.astype(jnp.float32)
        first, second = 1 - jnp.float32(b1) ** step, 1 - jnp.float32(b2) ** step
        out, new_mu, new_nu = [], [], []
        for i, (g, m, v) in enumerate(zip(grads, mus, nus)):
            g32 = g.astype(jnp.float32)
            m32 = b1 * m.astype(jnp.float32) + (1 - b1) * g32
            v32 = b2 * v.astype(jnp.float32) + (1 - b2) * (g32 * g32)
            out.append(((m32 / first) / (jnp.sqrt(v32 / second) + eps)).astype(g.dtype))
            bits = random_bits(g.shape, count, i)  # one hash an element: its high half rounds nu, its low half mu
            new_mu.append(stochastic_round(m32, bits << 16, moment_dtype))
            new_nu.append(stochastic_round(v32, bits, moment_dtype))
        return treedef.unflatten(out), LowPrecisionAdamState(count, treedef.unflatten(new_mu),
                                                             treedef.unflatten(new_nu))

    return optax.GradientTransformation(init, update)
