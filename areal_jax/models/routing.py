"""A mixture of experts' routing (`route`), its per-layer statistics (`router_stats`) and transformers' auxiliary
load-balancing loss (`load_balancing_loss`); `models.moe` runs the experts."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def route(logits: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] float32, experts [N, k] int32) of router logits [N, E]: the top k softmax probabilities,
    renormalised over the k when asked. Ties go to the lower expert index (as torch.topk on CPU)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def router_stats(logits: jax.Array, k: int, mask: jax.Array, experts: jax.Array | None = None) -> jax.Array:
    """[2, E] float32 of router logits [N, E] over the tokens where mask [N] is set: row 0 counts each expert's
    top-k picks, row 1 sums its softmax probability (differentiable; the counts are not). experts [N, k]: the picks
    when the caller has routed already (`route` of the same logits), else taken here."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    m = mask.astype(jnp.float32)[:, None]
    picks = jax.lax.top_k(probs, k)[1] if experts is None else experts
    counts = jax.nn.one_hot(picks, probs.shape[-1], dtype=jnp.float32).sum(axis=1)
    return jnp.stack([jax.lax.stop_gradient(jnp.sum(counts * m, axis=0)), jnp.sum(probs * m, axis=0)])


def load_balancing_loss(stats: jax.Array, tokens: jax.Array) -> jax.Array:
    """transformers' auxiliary load-balancing loss (``load_balancing_loss_func``) from per-layer `router_stats`
    [L, 2, E] over `tokens` real tokens: E * sum_e f_e * P_e, with f_e the share of (token, layer) pairs that pick
    expert e (summed over the k picks) and P_e its mean probability, both over every layer's tokens together.
    k when the load is uniform; 0 without tokens."""
    n = jnp.maximum(tokens.astype(jnp.float32) * stats.shape[0], 1.0)
    picks, probs = stats[:, 0].sum(axis=0) / n, stats[:, 1].sum(axis=0) / n
    return stats.shape[-1] * jnp.sum(picks * probs)
