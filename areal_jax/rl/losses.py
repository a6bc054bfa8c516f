"""Policy-gradient and auxiliary losses: pure, jit- and grad-able functions of [B, T] arrays.

Every policy loss takes the same keyword names (``eps_clip``, ``eps_clip_high``, ``behav_weight_cap``,
``behav_weight_mode``, ``dual_clip``, ``agg``) and returns ``(loss, stats)``: ``loss`` is a scalar and
``stats`` a dict of scalar diagnostics (no gradient) computed over the valid tokens of ``mask``.

Shapes: ``B`` sequences (rows) of ``T`` tokens. ``mask: [B, T]`` float or bool marks the tokens that
enter the loss (completion tokens, not prompt or padding). Values at masked positions may be anything
finite or not: they are replaced before any exponential so they cannot produce NaN in the loss or its
gradient.

Aggregation modes (``agg``), with ``m`` the valid-token mask and ``l`` the per-token loss:
  * ``"token-mean"``: ``sum(l * m) / sum(m)``.
  * ``"seq-mean-token-mean"``: per row ``sum_t(l * m) / sum_t(m)``, then the mean over rows holding at
    least one valid token.
  * ``"seq-mean-token-sum"``: per row ``sum_t(l * m)``, then the mean over rows holding at least one
    valid token.
Every division is guarded, so an all-masked batch gives a loss of 0 rather than NaN.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array
Agg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
BEHAV_WEIGHT_MODES: tuple[str, ...] = ("mask", "clamp")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def _float_dtype(x: Array) -> jnp.dtype:
    """The float dtype computations run in: x's own float dtype, at least float32."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.result_type(float)
    return jnp.promote_types(dtype, jnp.float32)


def _safe_div(num: Array, den: Array) -> Array:
    """num / den, 0 where den == 0 (no NaN in the value or the gradient)."""
    return num / jnp.where(den > 0, den, 1.0)


def aggregate(per_token: Array, mask: Array, agg: str = "token-mean") -> Array:
    """Reduce a per-token loss to a scalar.

    Args:
      per_token: [B, T] float, the loss of each token; positions with mask 0 are ignored.
      mask: [B, T] float or bool, valid tokens. It defines the denominators, so a token may be valid
        (counted) while contributing 0 to the numerator.
      agg: one of AGG_MODES (see the module docstring).
    Returns: [] float scalar.
    """
    _check_agg(agg)
    valid = mask.astype(bool)
    m = valid.astype(per_token.dtype)
    contrib = jnp.where(valid, per_token, 0.0)
    if agg == "token-mean":
        return _safe_div(contrib.sum(), m.sum())
    row_sum = contrib.sum(axis=-1)
    row_count = m.sum(axis=-1)
    row_has = (row_count > 0).astype(per_token.dtype)
    row_val = _safe_div(row_sum, row_count) if agg == "seq-mean-token-mean" else row_sum
    return _safe_div((row_val * row_has).sum(), row_has.sum())


def _check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"agg={agg!r} is not a known aggregation; use one of {AGG_MODES}.")


def _check_policy_options(eps_clip: float, eps_clip_high: float | None, behav_weight_cap: float | None,
                          behav_weight_mode: str, dual_clip: float | None, agg: str) -> float:
    """Validate the shared policy-loss options; return the effective upper clip epsilon."""
    _check_agg(agg)
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


def _masked_mean(x: Array, valid: Array) -> Array:
    return _safe_div(jnp.where(valid, x, 0.0).sum(), valid.sum().astype(x.dtype))


def _clipped_policy_loss(log_ratio: Array, prox_logp: Array, behav_logp: Array, advantages: Array,
                         valid: Array, kl_log_ratio: Array, *, eps_clip: float, eps_high: float,
                         behav_weight_cap: float | None, behav_weight_mode: str,
                         dual_clip: float | None, agg: str) -> tuple[Array, dict[str, Array]]:
    """Shared body of the clipped objectives, given the log ratio (token or sequence level).

    log_ratio: [B, T] log(pi_theta / pi_prox) used in the surrogate (already zero where invalid).
    kl_log_ratio: [B, T] per-token log(pi_theta / pi_prox) for the approx_kl statistic.
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
    loss = aggregate(per_token, valid, agg)

    sg = jax.lax.stop_gradient
    n_valid = valid.sum().astype(dtype)
    k3 = jnp.exp(-kl_log_ratio) + kl_log_ratio - 1.0
    stats = {
        "clip_fraction": _masked_mean(clipped.astype(dtype), valid),
        "dual_clip_fraction": _masked_mean(dual_active.astype(dtype), valid),
        "behav_weight_mean": _masked_mean(w, valid),
        "behav_weight_max": jnp.where(n_valid > 0, jnp.max(jnp.where(valid, w, -jnp.inf)), 0.0),
        "masked_fraction": _masked_mean((valid & ~keep).astype(dtype), valid),
        "approx_kl": _masked_mean(k3, valid),
        "n_tokens": n_valid,
        "n_seqs": valid.any(axis=-1).sum().astype(dtype),
    }
    return loss, {k: sg(v.astype(dtype)) for k, v in stats.items()}


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
      agg: aggregation mode, see the module docstring.
    Returns:
      loss: [] float.
      stats: dict of [] float, over valid tokens: clip_fraction (share where the clipped term is the
        active one), dual_clip_fraction, behav_weight_mean / behav_weight_max (of the uncapped w),
        masked_fraction (share of valid tokens dropped by the cap in mask mode), approx_kl (k3 estimate
        of KL(prox || theta), token mean), n_tokens, n_seqs (rows with a valid token).
    """
    eps_high = _check_policy_options(eps_clip, eps_clip_high, behav_weight_cap, behav_weight_mode,
                                     dual_clip, agg)
    dtype = _float_dtype(logp)
    valid = mask.astype(bool)
    log_ratio = jnp.where(valid, logp.astype(dtype) - prox_logp.astype(dtype), 0.0)
    return _clipped_policy_loss(log_ratio, prox_logp, behav_logp, advantages, valid, log_ratio,
                                eps_clip=eps_clip, eps_high=eps_high,
                                behav_weight_cap=behav_weight_cap,
                                behav_weight_mode=behav_weight_mode, dual_clip=dual_clip, agg=agg)


def ppo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *, eps_clip: float = 0.2,
             eps_clip_high: float | None = None, dual_clip: float | None = None,
             agg: Agg = "token-mean") -> tuple[Array, dict[str, Array]]:
    """The standard clipped PPO objective: decoupled_ppo_loss with prox_logp = behav_logp = old_logp.

    Per valid token: l = -min(u * A, clip(u, 1 - eps_clip, 1 + eps_clip_high) * A), u = exp(logp -
    old_logp). Shapes as in decoupled_ppo_loss; stats are the same (behaviour weights are all 1).
    """
    return decoupled_ppo_loss(logp, old_logp, old_logp, advantages, mask, eps_clip=eps_clip,
                              eps_clip_high=eps_clip_high, dual_clip=dual_clip, agg=agg)


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
    eps_high = _check_policy_options(eps_clip, eps_clip_high, behav_weight_cap, behav_weight_mode,
                                     dual_clip, agg)
    dtype = _float_dtype(logp)
    valid = mask.astype(bool)
    token_log_ratio = jnp.where(valid, logp.astype(dtype) - prox_logp.astype(dtype), 0.0)
    seq_log_ratio = _safe_div(token_log_ratio.sum(axis=-1), valid.sum(axis=-1).astype(dtype))
    log_ratio = jnp.where(valid, seq_log_ratio[:, None], 0.0)
    return _clipped_policy_loss(log_ratio, prox_logp, behav_logp, advantages, valid, token_log_ratio,
                                eps_clip=eps_clip, eps_high=eps_high,
                                behav_weight_cap=behav_weight_cap,
                                behav_weight_mode=behav_weight_mode, dual_clip=dual_clip, agg=agg)


def kl_penalty(logp: Array, ref_logp: Array, mask: Array, *, estimator: str = "k3",
               agg: Agg = "token-mean") -> Array:
    """Aggregated per-token KL estimate of KL(pi_theta || pi_ref) from sampled tokens.

    With d = logp - ref_logp: k1 = d, k2 = 0.5 * d^2, k3 = exp(-d) + d - 1 (= exp(ref - logp) - (ref -
    logp) - 1, non-negative and unbiased). logp, ref_logp: [B, T] float; mask: [B, T] float or bool.
    Returns a [] float scalar, to be added to a policy loss with a coefficient.
    """
    _check_agg(agg)
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is unknown; use one of {KL_ESTIMATORS}.")
    dtype = _float_dtype(logp)
    valid = mask.astype(bool)
    d = jnp.where(valid, logp.astype(dtype) - ref_logp.astype(dtype), 0.0)
    if estimator == "k1":
        per_token = d
    elif estimator == "k2":
        per_token = 0.5 * d * d
    else:
        per_token = jnp.exp(-d) + d - 1.0
    return aggregate(per_token, valid, agg)


def value_loss(values: Array, old_values: Array, returns: Array, mask: Array, *,
               value_clip: float | None = 0.2,
               agg: Agg = "token-mean") -> tuple[Array, dict[str, Array]]:
    """Clipped value loss: per token 0.5 * max((v - R)^2, (old_v + clip(v - old_v, -c, c) - R)^2).

    values: [B, T] float (differentiable), old_values: [B, T] float (values at rollout time),
    returns: [B, T] float targets, mask: [B, T] float or bool. value_clip None gives 0.5 * (v - R)^2.
    Returns (loss [] float, stats) with stats value_clip_fraction (share of valid tokens where the
    clipped error is the larger one) and value_error (token mean of (v - R)^2, no gradient).
    """
    _check_agg(agg)
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
    loss = aggregate(0.5 * per_token, valid, agg)
    stats = {"value_clip_fraction": _masked_mean(clipped.astype(dtype), valid),
             "value_error": _masked_mean(err, valid)}
    return loss, jax.tree.map(jax.lax.stop_gradient, stats)


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
