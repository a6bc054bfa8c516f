"""Policy-gradient and auxiliary losses: pure, jit- and grad-able functions of [B, T] arrays.

Every loss has two forms. The per-token form (``*_token_loss``, ``kl_token_penalty``) returns
``(per_token, token_stats)``: ``per_token: [B, T]`` the loss of each token (0 at masked tokens) and
``token_stats`` a dict of [B, T] per-token diagnostics (no gradient, 0 at masked tokens). The aggregated
form (``decoupled_ppo_loss``, ``ppo_loss``, ``gspo_loss``, ``kl_penalty``, ``value_loss``) is the per-token
form followed by the one aggregation of `rl.aggregation` (``aggregate(per_token, mask, agg)``) and, for
the policy losses, ``policy_stats``: it returns ``(loss, stats)`` with a scalar loss and scalar stats
over the valid tokens. The packed trainer calls the per-token forms on its packed rows and weights them
with ``rl.aggregation.token_weights`` computed over each minibatch, the same function.

Every policy loss takes the same keyword names (``eps_clip``, ``eps_clip_high``, ``behav_weight_cap``,
``behav_weight_mode``, ``dual_clip``, and ``agg`` for the aggregated forms).

Shapes: ``B`` sequences (rows) of ``T`` tokens. ``mask: [B, T]`` float or bool marks the tokens that
enter the loss (completion tokens, not prompt or padding). Values at masked positions may be anything
finite or not: they are replaced before any exponential so they cannot produce NaN in the loss or its
gradient. Aggregation modes (``agg``): see `rl.aggregation`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.rl.aggregation import AGG_MODES, Agg, aggregate, check_agg, masked_mean, segment_mean

Array = jax.Array
TokenStats = dict[str, Array]
BEHAV_WEIGHT_MODES: tuple[str, ...] = ("mask", "clamp")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
__all__ = [
    "AGG_MODES", "BEHAV_WEIGHT_MODES", "KL_ESTIMATORS", "aggregate", "decoupled_ppo_loss",
    "decoupled_ppo_token_loss", "gspo_loss", "gspo_token_loss", "kl_penalty", "kl_token_penalty",
    "policy_stats", "ppo_loss", "ppo_token_loss", "token_entropy", "token_logprobs", "value_loss",
    "value_token_loss",
]


def _float_dtype(x: Array) -> jnp.dtype:
    """The float dtype computations run in: x's own float dtype, at least float32."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.result_type(float)
    return jnp.promote_types(dtype, jnp.float32)


def _check_policy_options(eps_clip: float, eps_clip_high: float | None, behav_weight_cap: float | None,
                          behav_weight_mode: str, dual_clip: float | None) -> float:
    """Validate the shared policy-loss options; return the effective upper clip epsilon."""
    if not eps_clip >= 0.0:
        raise ValueError(f"eps_clip must be >= 0 (got {eps_clip}); 0.2 is the usual value.")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if not eps_high >= 0.0:
        raise ValueError(f"eps_clip_high must be >= 0 or None (got {eps_clip_high}).")
    if behav_weight_mode not in BEHAV_WEIGHT_MODES:
        raise ValueError(f"behav_weight_mode={behav_weight_mode!r} is unknown; use one of "
                         f"{BEHAV_WEIGHT_MODES}.")
    if behav_weight_cap is not None and not behav_weight_cap > 0.0:
        raise ValueError(f"behav_weight_cap must be > 0 or None (got {behav_weight_cap}); a typical "
                         "cap is 5.0.")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 or None (got {dual_clip}); 3.0 is a common value.")
    return float(eps_high)


def _clipped_token_loss(log_ratio: Array, prox_logp: Array, behav_logp: Array, advantages: Array,
                        valid: Array, kl_log_ratio: Array, *, eps_clip: float, eps_high: float,
                        behav_weight_cap: float | None, behav_weight_mode: str,
                        dual_clip: float | None) -> tuple[Array, TokenStats]:
    """Shared body of the clipped objectives, given the log ratio (token or sequence level).

    log_ratio: [B, T] log(pi_theta / pi_prox) used in the surrogate (already zero where invalid).
    kl_log_ratio: [B, T] per-token log(pi_theta / pi_prox) for the k3 statistic.
    Returns (per_token [B, T], token stats [B, T]: clipped, dual_clipped, behav_weight (uncapped w),
    masked (dropped by the cap in mask mode), k3), all 0 where invalid.
    """
    dtype = log_ratio.dtype
    adv = jnp.where(valid, advantages.astype(dtype), 0.0)
    ratio = jnp.exp(log_ratio)
    log_w = jnp.where(valid, prox_logp.astype(dtype) - behav_logp.astype(dtype), 0.0)
    w = jax.lax.stop_gradient(jnp.exp(log_w))

    surr_plain = ratio * adv
    surr_clip = jnp.clip(ratio, 1.0 - eps_clip, 1.0 + eps_high) * adv
    pg = -jnp.minimum(surr_plain, surr_clip)
    clipped = surr_clip < surr_plain
    if dual_clip is not None:
        cap = dual_clip * jnp.abs(adv)
        dual_active = (adv < 0) & (pg > cap)
        pg = jnp.where(dual_active, cap, pg)
    else:
        dual_active = jnp.zeros_like(valid)

    if behav_weight_cap is None:
        keep = valid
        w_eff = w
    elif behav_weight_mode == "mask":
        keep = valid & (w <= behav_weight_cap)
        w_eff = jnp.where(keep, w, 0.0)
    else:
        keep = valid
        w_eff = jnp.minimum(w, behav_weight_cap)
    per_token = jnp.where(keep, w_eff * pg, 0.0)

    k3 = jnp.exp(-kl_log_ratio) + kl_log_ratio - 1.0
    on = lambda x: jax.lax.stop_gradient(jnp.where(valid, x.astype(dtype), 0.0))  # noqa: E731
    stats = {"clipped": on(clipped), "dual_clipped": on(dual_active), "behav_weight": on(w),
             "masked": on(valid & ~keep), "k3": on(k3)}
    return per_token, stats


def policy_stats(token_stats: TokenStats, mask: Array) -> dict[str, Array]:
    """The scalar stats of a policy loss from its per-token stats, over the valid tokens of mask.

    token_stats: the [B, T] dict of a ``*_token_loss``; mask: [B, T] float or bool.
    Returns dict of [] float: clip_fraction, dual_clip_fraction, behav_weight_mean, behav_weight_max
    (0 without valid tokens), masked_fraction, approx_kl (token mean of k3), n_tokens, n_seqs (rows
    with a valid token).
    """
    valid = jnp.asarray(mask).astype(bool)
    w = token_stats["behav_weight"]
    dtype = w.dtype
    n_valid = valid.sum().astype(dtype)
    stats = {
        "clip_fraction": masked_mean(token_stats["clipped"], valid),
        "dual_clip_fraction": masked_mean(token_stats["dual_clipped"], valid),
        "behav_weight_mean": masked_mean(w, valid),
        "behav_weight_max": jnp.where(n_valid > 0, jnp.max(jnp.where(valid, w, -jnp.inf)), 0.0),
        "masked_fraction": masked_mean(token_stats["masked"], valid),
        "approx_kl": masked_mean(token_stats["k3"], valid),
        "n_tokens": n_valid,
        "n_seqs": valid.any(axis=-1).sum().astype(dtype),
    }
    return {k: jax.lax.stop_gradient(v.astype(dtype)) for k, v in stats.items()}


def decoupled_ppo_token_loss(logp: Array, prox_logp: Array, behav_logp: Array, advantages: Array,
                             mask: Array, *, eps_clip: float = 0.2, eps_clip_high: float | None = None,
                             behav_weight_cap: float | None = None, behav_weight_mode: str = "mask",
                             dual_clip: float | None = None) -> tuple[Array, TokenStats]:
    """Per-token form of decoupled_ppo_loss (see there for the formula and the options).

    Args: as decoupled_ppo_loss, all [B, T]. Returns (per_token [B, T] float, 0 at masked tokens and at
    tokens dropped by the cap; token_stats: clipped, dual_clipped, behav_weight, masked, k3, [B, T]).
    """
    eps_high = _check_policy_options(eps_clip, eps_clip_high, behav_weight_cap, behav_weight_mode,
                                     dual_clip)
    dtype = _float_dtype(logp)
    valid = mask.astype(bool)
    log_ratio = jnp.where(valid, logp.astype(dtype) - prox_logp.astype(dtype), 0.0)
    return _clipped_token_loss(log_ratio, prox_logp, behav_logp, advantages, valid, log_ratio,
                               eps_clip=eps_clip, eps_high=eps_high, behav_weight_cap=behav_weight_cap,
                               behav_weight_mode=behav_weight_mode, dual_clip=dual_clip)


def decoupled_ppo_loss(logp: Array, prox_logp: Array, behav_logp: Array, advantages: Array,
                       mask: Array, *, eps_clip: float = 0.2, eps_clip_high: float | None = None,
                       behav_weight_cap: float | None = None, behav_weight_mode: str = "mask",
                       dual_clip: float | None = None,
                       agg: Agg = "token-mean") -> tuple[Array, dict[str, Array]]:
    """The decoupled PPO objective of AReaL (behaviour, proximal and current policy).

    Per valid token, with u = exp(logp - prox_logp) and w = stop_gradient(exp(prox_logp - behav_logp)):
        l = -w * min(u * A, clip(u, 1 - eps_clip, 1 + eps_clip_high) * A).
    dual_clip c > 1: for A < 0 the token loss min(u, clip(u)) * |A| is capped at c * |A| (then times w).
    behav_weight_cap: None uses the plain w. With a cap, mode "mask" drops tokens with w > cap from the
    numerator while every valid token still counts in the denominator (so the cap does not inflate the
    other tokens' gradients); mode "clamp" uses min(w, cap).

    Args:
      logp: [B, T] float, log pi_theta(token), differentiable.
      prox_logp: [B, T] float, log-probs of the proximal policy (trainer params at the update start).
      behav_logp: [B, T] float, log-probs recorded by the sampler (the behaviour policy).
      advantages: [B, T] float.
      mask: [B, T] float or bool, tokens in the loss.
      agg: aggregation mode, see rl.aggregation.
    Returns:
      loss: [] float, aggregate(decoupled_ppo_token_loss(...)[0], mask, agg).
      stats: dict of [] float, over valid tokens: clip_fraction (share where the clipped term is the
        active one), dual_clip_fraction, behav_weight_mean / behav_weight_max (of the uncapped w),
        masked_fraction (share of valid tokens dropped by the cap in mask mode), approx_kl (k3 estimate
        of KL(prox || theta), token mean), n_tokens, n_seqs (rows with a valid token).
    """
    check_agg(agg)
    per_token, token_stats = decoupled_ppo_token_loss(
        logp, prox_logp, behav_logp, advantages, mask, eps_clip=eps_clip, eps_clip_high=eps_clip_high,
        behav_weight_cap=behav_weight_cap, behav_weight_mode=behav_weight_mode, dual_clip=dual_clip)
    return aggregate(per_token, mask, agg), policy_stats(token_stats, mask)


def ppo_token_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                   eps_clip: float = 0.2, eps_clip_high: float | None = None,
                   dual_clip: float | None = None) -> tuple[Array, TokenStats]:
    """Per-token form of ppo_loss: decoupled_ppo_token_loss with prox_logp = behav_logp = old_logp."""
    return decoupled_ppo_token_loss(logp, old_logp, old_logp, advantages, mask, eps_clip=eps_clip,
                                    eps_clip_high=eps_clip_high, dual_clip=dual_clip)


def ppo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *, eps_clip: float = 0.2,
             eps_clip_high: float | None = None, dual_clip: float | None = None,
             agg: Agg = "token-mean") -> tuple[Array, dict[str, Array]]:
    """The standard clipped PPO objective: decoupled_ppo_loss with prox_logp = behav_logp = old_logp.

    Per valid token: l = -min(u * A, clip(u, 1 - eps_clip, 1 + eps_clip_high) * A), u = exp(logp -
    old_logp). Shapes as in decoupled_ppo_loss; stats are the same (behaviour weights are all 1).
    """
    check_agg(agg)
    per_token, token_stats = ppo_token_loss(logp, old_logp, advantages, mask, eps_clip=eps_clip,
                                            eps_clip_high=eps_clip_high, dual_clip=dual_clip)
    return aggregate(per_token, mask, agg), policy_stats(token_stats, mask)


def gspo_token_loss(logp: Array, prox_logp: Array, behav_logp: Array, advantages: Array, mask: Array,
                    *, segment_ids: Array | None = None, eps_clip: float = 0.2,
                    eps_clip_high: float | None = None, behav_weight_cap: float | None = None,
                    behav_weight_mode: str = "mask",
                    dual_clip: float | None = None) -> tuple[Array, TokenStats]:
    """Per-token form of gspo_loss (see there), also for packed rows.

    segment_ids: [B, T] int or None. None: each row is one sequence. Given: the sequence ratio is taken
    per (row, segment id), so several trajectories packed into one row keep their own ratios.
    Other args as gspo_loss, all [B, T]. Returns (per_token [B, T], token_stats as
    decoupled_ppo_token_loss; k3 is the per-token estimate).
    """
    eps_high = _check_policy_options(eps_clip, eps_clip_high, behav_weight_cap, behav_weight_mode,
                                     dual_clip)
    dtype = _float_dtype(logp)
    valid = mask.astype(bool)
    token_log_ratio = jnp.where(valid, logp.astype(dtype) - prox_logp.astype(dtype), 0.0)
    log_ratio = segment_mean(token_log_ratio, valid, segment_ids)
    return _clipped_token_loss(log_ratio, prox_logp, behav_logp, advantages, valid, token_log_ratio,
                               eps_clip=eps_clip, eps_high=eps_high, behav_weight_cap=behav_weight_cap,
                               behav_weight_mode=behav_weight_mode, dual_clip=dual_clip)


def gspo_loss(logp: Array, prox_logp: Array, behav_logp: Array, advantages: Array, mask: Array, *,
              eps_clip: float = 0.2, eps_clip_high: float | None = None,
              behav_weight_cap: float | None = None, behav_weight_mode: str = "mask",
              dual_clip: float | None = None,
              agg: Agg = "token-mean") -> tuple[Array, dict[str, Array]]:
    """Group Sequence Policy Optimization (GSPO) with AReaL's behaviour weights.

    Definition. For row i with valid tokens V_i (|V_i| > 0) the sequence ratio is
        s_i = exp( (1 / |V_i|) * sum_{t in V_i} (logp[i, t] - prox_logp[i, t]) ),
    the geometric mean of the token ratios (gradients flow through every token of the row; s_i = 1 for
    a row without valid tokens). Every valid token (i, t) then takes the decoupled PPO token loss with
    u replaced by s_i:
        l[i, t] = -w[i, t] * min(s_i * A[i, t], clip(s_i, 1 - eps_clip, 1 + eps_clip_high) * A[i, t]),
    w[i, t] = stop_gradient(exp(prox_logp - behav_logp)) per token, with the same behav_weight_cap /
    behav_weight_mode and dual_clip handling as decoupled_ppo_loss, and the same ``agg``. The cap masks
    single tokens; s_i is always taken over all valid tokens of the row. With a sequence-constant
    advantage and agg="seq-mean-token-mean" (and w = 1) this is exactly the sequence-level GSPO loss
    -mean_i min(s_i A_i, clip(s_i) A_i). The GSPO paper clips much tighter than token-level PPO
    (eps_clip=3e-4, eps_clip_high=4e-4); the default 0.2 only keeps the signatures interchangeable.

    Shapes and stats as in decoupled_ppo_loss; clip_fraction counts tokens of clipped sequences and
    approx_kl stays the per-token k3 estimate.
    """
    check_agg(agg)
    per_token, token_stats = gspo_token_loss(
        logp, prox_logp, behav_logp, advantages, mask, eps_clip=eps_clip, eps_clip_high=eps_clip_high,
        behav_weight_cap=behav_weight_cap, behav_weight_mode=behav_weight_mode, dual_clip=dual_clip)
    return aggregate(per_token, mask, agg), policy_stats(token_stats, mask)


def kl_token_penalty(logp: Array, ref_logp: Array, mask: Array, *, estimator: str = "k3") -> Array:
    """Per-token KL estimate of KL(pi_theta || pi_ref) from sampled tokens, 0 at masked tokens.

    With d = logp - ref_logp: k1 = d, k2 = 0.5 * d^2, k3 = exp(-d) + d - 1 (= exp(ref - logp) - (ref -
    logp) - 1, non-negative and unbiased). logp, ref_logp: [B, T] float; mask: [B, T] float or bool.
    Returns [B, T] float.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is unknown; use one of {KL_ESTIMATORS}.")
    dtype = _float_dtype(logp)
    valid = mask.astype(bool)
    d = jnp.where(valid, logp.astype(dtype) - ref_logp.astype(dtype), 0.0)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return jnp.exp(-d) + d - 1.0


def kl_penalty(logp: Array, ref_logp: Array, mask: Array, *, estimator: str = "k3",
               agg: Agg = "token-mean") -> Array:
    """Aggregated kl_token_penalty: a [] float scalar, to be added to a policy loss with a coefficient.

    logp, ref_logp: [B, T] float; mask: [B, T] float or bool; estimator k1 | k2 | k3 (see
    kl_token_penalty).
    """
    check_agg(agg)
    return aggregate(kl_token_penalty(logp, ref_logp, mask, estimator=estimator), mask, agg)


def value_token_loss(values: Array, old_values: Array, returns: Array, mask: Array, *,
                     value_clip: float | None = 0.2) -> tuple[Array, TokenStats]:
    """Per-token clipped value loss: 0.5 * max((v - R)^2, (old_v + clip(v - old_v, -c, c) - R)^2).

    values: [B, T] float (differentiable), old_values: [B, T] float (values when the data was scored),
    returns: [B, T] float targets, mask: [B, T] float or bool. value_clip None gives 0.5 * (v - R)^2.
    Returns (per_token [B, T], token_stats: value_clipped (1 where the clipped error is the larger),
    value_error ((v - R)^2), [B, T], no gradient, 0 at masked tokens).
    """
    if value_clip is not None and not value_clip > 0.0:
        raise ValueError(f"value_clip must be > 0 or None (got {value_clip}).")
    dtype = _float_dtype(values)
    valid = mask.astype(bool)
    v = jnp.where(valid, values.astype(dtype), 0.0)
    old_v = jnp.where(valid, old_values.astype(dtype), 0.0)
    ret = jnp.where(valid, returns.astype(dtype), 0.0)
    err = (v - ret) ** 2
    if value_clip is None:
        per_token, clipped = err, jnp.zeros_like(valid)
    else:
        v_clip = old_v + jnp.clip(v - old_v, -value_clip, value_clip)
        err_clip = (v_clip - ret) ** 2
        per_token, clipped = jnp.maximum(err, err_clip), err_clip > err
    on = lambda x: jax.lax.stop_gradient(jnp.where(valid, x.astype(dtype), 0.0))  # noqa: E731
    return 0.5 * per_token, {"value_clipped": on(clipped), "value_error": on(err)}


def value_loss(values: Array, old_values: Array, returns: Array, mask: Array, *,
               value_clip: float | None = 0.2,
               agg: Agg = "token-mean") -> tuple[Array, dict[str, Array]]:
    """Clipped value loss: per token 0.5 * max((v - R)^2, (old_v + clip(v - old_v, -c, c) - R)^2).

    values: [B, T] float (differentiable), old_values: [B, T] float (values at rollout time),
    returns: [B, T] float targets, mask: [B, T] float or bool. value_clip None gives 0.5 * (v - R)^2.
    Returns (loss [] float, stats) with stats value_clip_fraction (share of valid tokens where the
    clipped error is the larger one) and value_error (token mean of (v - R)^2, no gradient).
    """
    check_agg(agg)
    per_token, token_stats = value_token_loss(values, old_values, returns, mask, value_clip=value_clip)
    stats = {"value_clip_fraction": masked_mean(token_stats["value_clipped"], mask),
             "value_error": masked_mean(token_stats["value_error"], mask)}
    return aggregate(per_token, mask, agg), stats


def token_logprobs(logits: Array, tokens: Array) -> Array:
    """log softmax(logits)[tokens], gathered without building a [B, T, V] log-softmax array.

    logits: [B, T, V] float (any float dtype; computed in at least float32); tokens: [B, T] int.
    Returns [B, T] float32 (or float64 for float64 logits).
    """
    logits = logits.astype(_float_dtype(logits))
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - lse


def token_entropy(logits: Array, mask: Array) -> Array:
    """Entropy of the next-token distribution at each position, 0 where mask is 0.

    H = lse - sum_v softmax(logits)_v * logits_v with lse = logsumexp(logits); under jit the
    softmax-times-logits reduction fuses, so no second [B, T, V] array is kept.
    logits: [B, T, V] float; mask: [B, T] float or bool. Returns [B, T] float32 (float64 for float64).
    """
    logits = logits.astype(_float_dtype(logits))
    lse = jax.nn.logsumexp(logits, axis=-1)
    finite = jnp.where(jnp.isfinite(logits), logits, 0.0)  # -inf logits have probability 0
    expected_logit = jnp.sum(jnp.exp(logits - lse[..., None]) * finite, axis=-1)
    return jnp.where(mask.astype(bool), lse - expected_logit, 0.0)
