"""Prefill as pure functions: prompt rows through the model once, their caches as Prefixes or written
into decode slots. The Engine jits them; the paged engine reuses prefill_rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models import KVCache, init_cache
from areal_jax.sampler.state import Prefix


def prefill_rows(model: nnx.Module, config, tokens: jax.Array, lengths: jax.Array) -> tuple[KVCache, jax.Array]:
    """tokens [R, P] int32 (tail padded), lengths [R] -> (cache of L layers [R, P, ...], logits [R, V] f32)."""
    r, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], (r, p))
    h, cache = model.hidden(tokens, positions, cache=init_cache(config, r, p))
    last = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)  # [R, 1, D]
    return cache, model.unembed(last)[:, 0].astype(jnp.float32)


def last_tokens(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """[R] the last real token of each tail-padded row of tokens [R, P]."""
    return jnp.take_along_axis(tokens, jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]


def row_prefixes(cache: KVCache, logits: jax.Array, tokens: jax.Array, lengths: jax.Array) -> tuple[Prefix, ...]:
    """prefill_rows' output as R one-row Prefixes (each its own buffers)."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    last = last_tokens(tokens, lengths)
    return tuple(
        Prefix(cache=jax.tree.map(lambda x, r=r: x[r : r + 1], cache), logits=logits[r], logprobs=logprobs[r],
               true_length=lengths[r].astype(jnp.int32), last_token=last[r])
        for r in range(tokens.shape[0]))


def write_rows(cache: KVCache, rows: KVCache, slots: jax.Array) -> KVCache:
    """Write each layer's rows [R, P, ...] into positions 0..P-1 of `slots` [n] of the decode cache; one row
    (R = 1) is copied to every slot. Slots out of range are dropped (padding of a batched call)."""
    n = slots.shape[0]

    def write(dst: jax.Array, src: jax.Array) -> jax.Array:
        p = src.shape[1]
        return dst.at[slots, :p].set(jnp.broadcast_to(src.astype(dst.dtype), (n,) + src.shape[1:]), mode="drop")

    return jax.tree.map(write, cache, rows)
