"""Advantage estimators and DAPO's overlong reward shaping: pure jnp functions.

Group-relative estimators (GRPO, Dr. GRPO, RLOO) work on one scalar reward per completion, laid out
group after group: ``rewards[g * group_size + j]`` is completion j of prompt g. GAE works per token on
[B, T] arrays with a loss mask whose zeros are skipped (padding after the end, or masked spans).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
GROUP_MODES: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "rank")


def _float(x: Array) -> Array:
    x = jnp.asarray(x)
    dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.result_type(float)
    return x.astype(jnp.promote_types(dtype, jnp.float32))


def group_advantages(rewards: Array, group_size: int, *, mode: str = "grpo",
                     eps: float = 1e-6) -> Array:
    """Group-relative advantages, one per completion.

    Within each group of ``group_size`` consecutive rewards, with mean m and population standard
    deviation s (ddof 0) of the group:
      * "grpo":    (r - m) / (s + eps)
      * "dr_grpo": r - m                      (Dr. GRPO: no std normalisation)
      * "rloo":    r - mean of the other group_size - 1 rewards  (= (r - m) * n / (n - 1))
      * "rank":    rank(r) / (n - 1) - 1/2, rank the 0-based position of r in the sorted group (tied
                   rewards share their mean rank): centred in [-1/2, 1/2] and unchanged by any increasing
                   transform of the reward. For 0/1 rewards it is "dr_grpo" times n / (2 (n - 1)); with
                   graded rewards (e.g. code pass rates) only their order counts, not their gaps.
    A group of identical rewards gives exact zeros in every mode.

    Args:
      rewards: [n_groups * group_size] float.
      group_size: completions per prompt (static python int, >= 1; >= 2 for "rloo" and "rank").
    Returns: [n_groups * group_size] float32 (float64 for float64 input).
    """
    if mode not in GROUP_MODES:
        raise ValueError(f"mode={mode!r} is not a group advantage mode; use one of {GROUP_MODES}.")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int (got {group_size!r}).")
    if mode in ("rloo", "rank") and group_size < 2:
        raise ValueError(f"mode={mode!r} needs group_size >= 2: a group of one has no other completion to "
                         "compare with. Sample several completions per prompt or use mode='grpo'.")
    r = _float(rewards)
    if r.ndim != 1 or r.shape[0] % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a length that is a multiple of group_size="
                         f"{group_size} (got shape {r.shape}); lay rewards out group after group.")
    groups = r.reshape(-1, group_size)
    mean = groups.mean(axis=1, keepdims=True)
    centred = groups - mean
    if mode == "grpo":
        std = jnp.sqrt(jnp.mean(centred * centred, axis=1, keepdims=True))
        out = centred / (std + eps)
    elif mode == "dr_grpo":
        out = centred
    elif mode == "rank":
        below = jnp.sum(groups[:, :, None] > groups[:, None, :], axis=2)  # [G, n]: rewards strictly smaller
        ties = jnp.sum(groups[:, :, None] == groups[:, None, :], axis=2)  # [G, n]: equal ones, itself included
        out = (below + (ties - 1) / 2) / (group_size - 1) - 0.5
    else:
        out = centred * (group_size / (group_size - 1))
    # The float mean of identical values need not equal them exactly; force exact zeros there.
    identical = groups.max(axis=1, keepdims=True) == groups.min(axis=1, keepdims=True)
    return jnp.where(identical, 0.0, out).reshape(-1)


def gae(rewards: Array, values: Array, mask: Array, *, gamma: float,
        lam: float) -> tuple[Array, Array]:
    """Generalised advantage estimation per token, by a reverse jax.lax.scan over time.

    Only valid tokens (mask 1) take part: walking backwards, each valid token t sees as its successor
    the next valid token t' of its row (a terminal state with value 0 if there is none), so
        delta_t = r_t + gamma * V_t' - V_t,    A_t = delta_t + gamma * lam * A_t',
    and padding after the end (or any masked span) is skipped. Rewards at masked positions are ignored:
    put a sequence reward on its last valid token.

    Args:
      rewards: [B, T] float per-token rewards.
      values: [B, T] float value estimates V(s_t).
      mask: [B, T] float or bool.
      gamma, lam: discount and GAE lambda in [0, 1].
    Returns: (advantages, returns), each [B, T] float, returns = advantages + values; 0 where masked.
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1] (got gamma={gamma}, lam={lam}).")
    r = _float(rewards)
    v = _float(values).astype(r.dtype)
    if r.shape != v.shape or r.shape != jnp.shape(mask) or r.ndim != 2:
        raise ValueError(f"rewards, values and mask must share one [B, T] shape (got {r.shape}, "
                         f"{v.shape}, {jnp.shape(mask)}).")
    valid = jnp.asarray(mask).astype(bool)
    r = jnp.where(valid, r, 0.0)
    v = jnp.where(valid, v, 0.0)

    def step(carry: tuple[Array, Array], xs: tuple[Array, Array, Array]):
        next_value, next_adv = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_value - v_t
        adv = delta + gamma * lam * next_adv
        new_carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv, next_adv))
        return new_carry, jnp.where(m_t, adv, 0.0)

    zeros = jnp.zeros(r.shape[0], r.dtype)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, valid.T), reverse=True)
    advantages = adv_t.T
    return advantages, jnp.where(valid, advantages + v, 0.0)


def overlong_penalty(lengths: Array, max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> Array:
    """DAPO's soft overlong punishment, added to the reward (in a job: rollout.overlong_buffer > 0, with
    max_len = rollout.max_new_tokens and penalty_factor = rollout.overlong_penalty; the controller adds it
    before the group advantages).

    0 for lengths up to max_len - buffer_len, then linear down to -penalty_factor at max_len, and
    -penalty_factor beyond: penalty = clip((max_len - buffer_len - L) / buffer_len, -1, 0) * factor.

    lengths: [N] int completion lengths. Returns [N] float32.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must satisfy 0 < buffer_len <= max_len (got buffer_len="
                         f"{buffer_len}, max_len={max_len}).")
    lengths = _float(lengths)
    frac = (max_len - buffer_len - lengths) / buffer_len
    return jnp.clip(frac, -1.0, 0.0) * penalty_factor
