"""Expert parallelism for `models.moe.MoE` under a mesh context: each device of the batch axis (fsdp) holds
num_experts / fsdp whole experts instead of a 1 / fsdp slice of every expert, and the tokens go to the experts rather
than the experts' weights to the tokens.

Dispatch is by all-gather, dropless and exact: inside the MoE layer's shard_map each device routes its own rows,
then gathers every device's rows with their routing (`gather_pairs`: [tokens of all shards, D] plus the [.., k]
weights and picks), runs its own experts on the (token, expert) pairs that picked them (`local_pairs` marks the
others with the sentinel id `count`, weight 0: the expert paths skip or zero them), and a reduce-scatter
(`scatter_outputs`) sums each token's partial outputs from every device back onto the device that owns the token.
The backward is the transpose: the outputs' cotangents all-gathered, the inputs' reduce-scattered.

What crosses devices per layer and micro-batch: the batch's activations [N, D] four times (gathered and reduce-scattered in
the forward, the same in the backward), each (fsdp - 1) / fsdp of them, where FSDP moves the experts' weights 3 E D F
three times (gathered for the forward and again for the backward, their gradients reduce-scattered). The tokens are
the cheaper below N = 2.25 E F tokens a micro-batch: about 221k at Qwen3-30B-A3B's shape (E = 128, F = 768), 1.2M at
DeepSeek-V3's (256 x 2048), whose 22.5 GB of bf16 experts a layer one device could not gather at all.

Static shapes: a device may receive any number of pairs, up to every gathered token's k, so the expert paths size
their row buffers for N * k of the global batch (the blocked path's gathered rows and outputs, [N * k, D]: a larger
transient than FSDP's of N / fsdp * k), and compute only the blocks that hold this device's pairs (a `lax.cond` a
block in the scan, a skipped grid program in the Pallas kernel). Expected work per device is that of FSDP.

The all-gather's buffers grow with the fsdp size (a device holds every device's rows). `ring_dispatch`
(``ModelConfig.expert_dispatch="ring"``) keeps them flat instead: each device's rows, routing and an accumulator of
their outputs travel once around the fsdp ring (`jax.lax.ppermute`, one neighbour a step), every device adding its
experts' share on the way, so a device holds one other device's rows at a time. Its backward (`jax.custom_vjp`)
sends the rows round again with their output cotangents and recomputes each step's expert forward, so it saves
nothing per step either. Cost against the all-gather: one more expert forward, and (5n - 3) / (4n - 4) of its bytes
on n devices (1.42x at 4, 1.32x at 8, towards 1.25x: the rows travel again in the backward, and the outputs and
input cotangents take n steps home where a reduce-scatter moves n - 1 shares); the memory no longer grows with n.

Taken when `ModelConfig.expert_parallel` is on (the default) and the expert count divides the fsdp axis (the
expert weights' logical axis "experts" then shards over it, `models.sharding`); otherwise the experts are FSDP's.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from areal_jax.models.sharding import BATCH_AXIS


def expert_shards(num_experts: int, row_shards: int, enabled: bool) -> int:
    """Over how many devices the experts spread: the batch axis's size when expert parallelism is on, the rows split
    over that axis (row_shards > 1) and the expert count divides it; else 1 (each device sees every expert)."""
    if not enabled or row_shards <= 1 or num_experts % row_shards:
        return 1
    return row_shards


def dispatch(path, h: jax.Array, gate, up, down, weights: jax.Array, chosen: jax.Array, act, bias: tuple, *,
             shards: int) -> jax.Array:
    """Inside the MoE layer's shard_map over the batch axis: an expert path (`models.moe`'s, same arguments) run on
    every shard's tokens for this device's experts (gate, up, down: [E / shards, ...]), then each token's partial
    outputs summed onto its own shard: [n, D] for this shard's rows h [n, D] and their weights, picks [n, k]."""
    h_all, w_all, c_all = gather_pairs(h, weights, chosen)
    local, w_local = local_pairs(c_all, w_all, up.shape[0])
    return scatter_outputs(path(h_all, gate, up, down, w_local, local, act, bias, shards=shards))


def gather_pairs(h: jax.Array, weights: jax.Array, chosen: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inside a shard_map over the batch axis: every shard's rows h [n, D], routing weights and picks [n, k], as
    [shards * n, ...] in shard order (the same on every device)."""
    return tuple(jax.lax.all_gather(a, BATCH_AXIS, tiled=True) for a in (h, weights, chosen))


def local_pairs(chosen: jax.Array, weights: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """This device's share of the gathered pairs: its experts are `count` consecutive global ids starting at
    axis_index * count. Returns (local ids [N, k] in [0, count], `count` marking another device's expert, and the
    weights [N, k] with those pairs' set to 0)."""
    first = jax.lax.axis_index(BATCH_AXIS) * count
    local = chosen - first
    mine = (local >= 0) & (local < count)
    return jnp.where(mine, local, count).astype(jnp.int32), jnp.where(mine, weights, 0).astype(weights.dtype)


def scatter_outputs(out: jax.Array) -> jax.Array:
    """Every device's partial outputs [shards * n, D] for the gathered tokens summed, each shard's own n rows kept."""
    return jax.lax.psum_scatter(out, BATCH_AXIS, scatter_dimension=0, tiled=True)


def ring_dispatch(path, h: jax.Array, gate, up, down, weights: jax.Array, chosen: jax.Array, act, bias: tuple, *,
                  shards: int) -> jax.Array:
    """`dispatch`'s result, with the rows passed around the ring instead of all-gathered (module docstring): the
    same arguments, at most two shards' rows held at once in the forward and the backward."""
    return _ring(path, act, shards, h, weights, chosen, (gate, up, down, bias))


def _rotate(tree: Any, shards: int) -> Any:
    """Every array of `tree` sent to the next device of the ring (device i's to i + 1)."""
    perm = [(i, (i + 1) % shards) for i in range(shards)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, BATCH_AXIS, perm), tree)


def _local(path, act, shards: int, x: jax.Array, w: jax.Array, c: jax.Array, params: tuple) -> jax.Array:
    """This device's experts' weighted outputs [n, D] for one shard's rows x [n, D], weights w and picks c [n, k]."""
    gate, up, down, bias = params
    local, w_local = local_pairs(c, w, up.shape[0])
    return path(x, gate, up, down, w_local, local, act, bias, shards=shards)


def _circle(step, moving: tuple, still: Any, shards: int, last: int) -> tuple:
    """Runs step(moving, still) -> (moving, still) once on each device's block as it passes: `moving` (a block's
    inputs and accumulators) goes to the next device after every step, `still` (this device's own accumulators) stays.
    After `shards` steps the first `last` entries of `moving` take one more step round, which brings them home."""
    def body(carry, _):
        moving, still = step(*carry)
        return (_rotate(moving, shards), still), None

    (moving, still), _ = jax.lax.scan(body, (moving, still), None, length=shards - 1)
    moving, still = step(moving, still)
    return _rotate(moving[:last], shards), still


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(path, act, shards: int, h: jax.Array, weights: jax.Array, chosen: jax.Array, params: tuple) -> jax.Array:
    def step(moving, still):
        acc, x, w, c = moving
        return (acc + _local(path, act, shards, x, w, c, params), x, w, c), still

    return _circle(step, (jnp.zeros_like(h), h, weights, chosen), (), shards, 1)[0][0]


def _is_primal(z: Any) -> bool:
    return isinstance(z, jax.custom_derivatives.CustomVJPPrimal)


def _ring_fwd(path, act, shards: int, h, weights, chosen, params):
    # the residuals are the inputs (the backward recomputes every step); `trained` marks the parameters that take
    # gradients with a scalar, the frozen ones (a LoRA base, experts outside the adapters) with None: they get none,
    # and no weight product is spent on them
    leaves, tree = jax.tree.flatten(params, is_leaf=_is_primal)
    trained = [jnp.zeros((), jnp.int8) if leaf.perturbed else None for leaf in leaves]
    params = jax.tree.unflatten(tree, [leaf.value for leaf in leaves])
    h, weights, chosen = h.value, weights.value, chosen.value
    return _ring(path, act, shards, h, weights, chosen, params), (h, weights, chosen, params, trained)


def _ring_bwd(path, act, shards: int, res: tuple, g: Any) -> tuple:
    h, weights, chosen, params, trained = res
    leaves, tree = jax.tree.flatten(params)
    which = [i for i, mark in enumerate(trained) if mark is not None]
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        g = jnp.zeros(h.shape, h.dtype)

    def step(moving, grads):
        dx, dw, x, w, c, gb = moving

        def local(x, w, train):
            full = list(leaves)
            for i, value in zip(which, train):
                full[i] = value
            return _local(path, act, shards, x, w, c, jax.tree.unflatten(tree, full))

        _, pullback = jax.vjp(local, x, w, [leaves[i] for i in which])
        gx, gw, gp = pullback(gb)
        return (dx + gx, dw + gw, x, w, c, gb), [a + b.astype(jnp.float32) for a, b in zip(grads, gp)]

    zeros = [jnp.zeros(leaves[i].shape, jnp.float32) for i in which]
    (dx, dw), grads = _circle(step, (jnp.zeros_like(h), jnp.zeros_like(weights), h, weights, chosen, g), zeros,
                              shards, 2)
    full: list = [None] * len(leaves)
    for i, grad in zip(which, grads):
        full[i] = grad.astype(leaves[i].dtype)
    return dx, dw, None, jax.tree.unflatten(tree, full)


_ring.defvjp(_ring_fwd, _ring_bwd, symbolic_zeros=True)
