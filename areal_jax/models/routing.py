"""A mixture of experts' routing (`route`), its per-layer statistics (`router_stats`) and transformers' auxiliary
load-balancing loss (`load_balancing_loss`); `models.moe` runs the experts."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Scoring(NamedTuple):
    """How a router turns logits into picks and weights beyond top-k (`ModelConfig`'s router fields): "softmax" or
    "sigmoid" scores; groups (n_group, topk_group) or None, a group ranked by the sum of its two best scores with
    sigmoid scores (DeepSeek-V3) and by its best score with softmax ones (DeepSeek-V2); the weights' factor;
    "sparsemixer" (PhiMoE: `sparsemixer`) and its relative margin `jitter`; eps: what the renormalising sum takes
    besides the weights (None: transformers' 1e-20 with sigmoid scores, 0 with softmax ones; LFM2-MoE's 1e-6)."""
    scoring: str = "softmax"
    groups: tuple[int, int] | None = None
    scale: float = 1.0
    jitter: float = 0.01
    eps: float | None = None


def scores_of(logits: jax.Array, scoring: Scoring) -> jax.Array:
    """float32 [N, E] per-expert scores of router logits: the softmax over the experts, or each one's sigmoid (the
    softmax for sparsemixer, whose weights `sparsemixer` gives: these feed the routing statistics)."""
    logits = logits.astype(jnp.float32)
    return jax.nn.sigmoid(logits) if scoring.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)


def weights_of(scores: jax.Array, experts: jax.Array, renormalize: bool, scoring: Scoring) -> jax.Array:
    """The routing weights [N, k] of picked `experts` [N, k]: their scores, renormalised over the k when asked
    (the scoring's eps in the sum), times the scoring's factor."""
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        eps = scoring.eps if scoring.eps is not None else 1e-20 if scoring.scoring == "sigmoid" else 0.0
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + eps)
    return weights * jnp.float32(scoring.scale) if scoring.scale != 1.0 else weights


def sparsemixer(logits: jax.Array, experts: jax.Array, jitter: float) -> jax.Array:
    """PhiMoE's routing weights [N, k] float32 of picks `experts` [N, k] (transformers' `sparsemixer` in eval mode,
    which picks each expert as the largest logit the earlier picks left): the j-th pick's weight is its probability
    under a softmax over the logits l that neither an earlier pick holds nor lie beyond a relative margin of the
    pick's own logit t, (t - l) / max(|l|, t) > 2 jitter (that test without gradient, as transformers'). Not
    renormalised. Given picks (router replay) are weighed the same way."""
    logits = logits.astype(jnp.float32)
    fixed = jax.lax.stop_gradient(logits)
    index = jnp.arange(logits.shape[-1])
    taken = jnp.zeros(logits.shape, bool)
    weights = []
    for j in range(experts.shape[-1]):
        pick = experts[..., j:j + 1]
        top = jnp.take_along_axis(fixed, pick, axis=-1)
        far = (top - fixed) / jnp.maximum(jnp.abs(fixed), top) > 2 * jitter
        probs = jax.nn.softmax(jnp.where(far | taken, -jnp.inf, logits), axis=-1)
        weights.append(jnp.take_along_axis(probs, pick, axis=-1))
        taken = taken | (index == pick)
    return jnp.concatenate(weights, axis=-1)


def replay_weights(logits: jax.Array, experts: jax.Array, renormalize: bool, scoring: Scoring) -> jax.Array:
    """The weights [N, k] this router gives picks `experts` [N, k] another forward chose (rollout routing replay)."""
    if scoring.scoring == "sparsemixer":
        return sparsemixer(logits, experts, scoring.jitter) * jnp.float32(scoring.scale)
    return weights_of(scores_of(logits, scoring), experts, renormalize, scoring)


def route(logits: jax.Array, k: int, renormalize: bool, scoring: Scoring = Scoring(),
          score_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] float32, experts [N, k] int32) of router logits [N, E]: the top k scores (`scores_of`; plus
    score_bias [E] for picking only, never in the weights), within the best topk_group of n_group groups when the
    scoring has groups (ranked as `Scoring` says); weights by `weights_of`. Ties go to the lower expert index (as
    torch.topk on CPU)."""
    if scoring.scoring == "sparsemixer":  # the largest logits, one after another
        experts = jax.lax.top_k(logits.astype(jnp.float32), k)[1].astype(jnp.int32)
        return replay_weights(logits, experts, renormalize, scoring), experts
    scores = scores_of(logits, scoring)
    choice = scores if score_bias is None else scores + jax.lax.stop_gradient(score_bias.astype(jnp.float32))
    if scoring.groups is not None:
        n_group, keep = scoring.groups
        grouped = choice.reshape(*choice.shape[:-1], n_group, -1)
        if scoring.scoring == "sigmoid":
            rank = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, n_group]
        else:
            rank = jnp.max(grouped, axis=-1)
        best = jax.lax.top_k(rank, keep)[1]
        kept = jnp.any(best[..., :, None] == jnp.arange(n_group), axis=-2)  # [N, n_group]
        choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
    experts = jax.lax.top_k(choice, k)[1].astype(jnp.int32)
    return weights_of(scores, experts, renormalize, scoring), experts


def router_stats(logits: jax.Array, k: int, mask: jax.Array, experts: jax.Array | None = None,
                 scoring: Scoring = Scoring()) -> jax.Array:
    """[2, E] float32 of router logits [N, E] over the tokens where mask [N] is set: row 0 counts each expert's
    top-k picks, row 1 sums its score as a share of the token's (differentiable; the counts are not): the softmax
    probability, or with sigmoid scores each score over the token's sum of them (DeepSeek-V3's balance loss).
    experts [N, k]: the picks when the caller has routed already (`route` of the same logits), else the top k of the
    scores."""
    probs = scores_of(logits, scoring)
    if scoring.scoring == "sigmoid":
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
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
