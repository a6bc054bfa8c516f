"""Attention sinks (gpt-oss, `ModelConfig.attention_sinks`): a learned logit per query head that joins every query's
softmax as one more key whose value is zero, so the weights of the real keys sum to less than one.

Paths that hold a query's scores at once append the sink as a last column and drop it after the softmax
(`sink_softmax`, HF's eager attention); online-softmax paths start their running max at the sink's logit and their
running sum at its exp(0) = 1 (`sink_start`), the same result. A query with no visible key gets a zero output
(only the sink, of value zero, is visible). The sink joins the scaled (and soft-capped) scores as it is.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_sinks(sinks: jax.Array, kv_heads: int) -> jax.Array:
    """sinks [H] -> [K, H // K] float32: query head h = k * group + g's sink at [k, g] (the grouped queries' order)."""
    return sinks.astype(jnp.float32).reshape(kv_heads, -1)


def sink_softmax(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """scores [B, K, G, T, S] float32 (masked entries at a large negative value); sinks [H] or None -> the softmax
    over S with each query head's sink as one more key, that key dropped from the result: [B, K, G, T, S] float32
    (the plain softmax without sinks)."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = grouped_sinks(sinks, scores.shape[1])[None, :, :, None, None]
    sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def sink_start(sinks: jax.Array | None, shape: tuple[int, int, int, int],
               empty_max: float) -> tuple[jax.Array, jax.Array]:
    """The (running max, running sum) an online softmax over queries of shape [B, K, G, T] starts from, float32:
    each query head's sink logit and 1 (the sink seen first), or ``empty_max`` and 0 without sinks."""
    if sinks is None:
        return jnp.full(shape, empty_max, jnp.float32), jnp.zeros(shape, jnp.float32)
    start = jnp.broadcast_to(grouped_sinks(sinks, shape[1])[None, :, :, None], shape)
    return start, jnp.ones(shape, jnp.float32)
