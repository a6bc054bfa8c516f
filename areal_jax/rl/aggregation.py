"""The one aggregation of per-token values into a loss: token weights, the weighted sum, segment means.

Every loss in `rl.losses` has a per-token form returning ``[B, T]`` values; the scalar loss is always
``aggregate(per_token, mask, agg) == sum(token_weights(mask, agg) * per_token)`` over the valid tokens.
The trainer computes the same ``token_weights`` over a whole PPO minibatch before packing it into
micro-steps, so the sum over its micro-steps is exactly this aggregation however the tokens are packed.

Aggregation modes (``agg``), with ``m`` the valid-token mask and ``l`` the per-token loss:
  * ``"token-mean"``: ``sum(l * m) / sum(m)``, weight ``1 / N`` (N valid tokens).
  * ``"seq-mean-token-mean"``: per row ``sum_t(l * m) / sum_t(m)``, then the mean over rows holding at
    least one valid token; weight ``1 / (S * n_i)`` (S such rows, n_i valid tokens in row i).
  * ``"seq-mean-token-sum"``: per row ``sum_t(l * m)``, then the mean over rows holding at least one
    valid token; weight ``1 / S``.
Every division is guarded, so an all-masked batch gives weights (and a loss) of 0 rather than NaN.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array
Agg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def check_agg(agg: str) -> None:
    """Raise ValueError naming the known modes when `agg` is not one of AGG_MODES."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg={agg!r} is not a known aggregation; use one of {AGG_MODES}.")


def safe_div(num: Array, den: Array) -> Array:
    """num / den, 0 where den == 0 (no NaN in the value or the gradient)."""
    return num / jnp.where(den > 0, den, 1.0)


def token_weights(mask: Array, agg: str = "token-mean", dtype: jnp.dtype = jnp.float32) -> Array:
    """Per-token weights w such that aggregate(l, mask, agg) == sum(w * l) for any per-token l.

    Args:
      mask: [B, T] float or bool, valid tokens (they define the denominators; see the module docstring).
      agg: one of AGG_MODES.
      dtype: float dtype of the result.
    Returns: [B, T] dtype, 0 where mask is 0; the weights of the valid tokens sum to 1
      (token-mean, seq-mean-token-mean) or to the mean valid-token count per row (seq-mean-token-sum),
      and to 0 when no token is valid.
    """
    check_agg(agg)
    m = jnp.asarray(mask).astype(bool).astype(dtype)
    if agg == "token-mean":
        return safe_div(m, m.sum())
    row_count = m.sum(axis=-1, keepdims=True)
    n_rows = (row_count > 0).astype(dtype).sum()
    if agg == "seq-mean-token-mean":
        return safe_div(m, row_count * n_rows)
    return safe_div(m, n_rows)


def aggregate(per_token: Array, mask: Array, agg: str = "token-mean") -> Array:
    """Reduce a per-token loss to a scalar: sum(token_weights(mask, agg) * per_token).

    Args:
      per_token: [B, T] float, the loss of each token; positions with mask 0 are ignored (they may hold
        anything, NaN included).
      mask: [B, T] float or bool, valid tokens. It defines the denominators, so a token may be valid
        (counted) while contributing 0 to the numerator.
      agg: one of AGG_MODES (see the module docstring).
    Returns: [] float scalar in per_token's dtype.
    """
    valid = jnp.asarray(mask).astype(bool)
    contrib = jnp.where(valid, per_token, 0.0)
    return jnp.sum(token_weights(valid, agg, per_token.dtype) * contrib)


def masked_mean(x: Array, mask: Array) -> Array:
    """Mean of x over the valid tokens of mask (0 when none). x, mask: [B, T]. Returns []."""
    valid = jnp.asarray(mask).astype(bool)
    return safe_div(jnp.where(valid, x, 0.0).sum(), valid.sum().astype(x.dtype))


def segment_mean(x: Array, mask: Array, segment_ids: Array | None = None) -> Array:
    """Each valid token's value replaced by the mean of x over the valid tokens of its sequence.

    A sequence is a row (segment_ids None) or, in packed rows, the tokens of one row sharing a segment
    id (ids need not be contiguous; id 0 is padding and is ignored like any masked token).

    Args:
      x: [B, T] float; values at masked positions are ignored.
      mask: [B, T] float or bool.
      segment_ids: [B, T] int in [0, T] or None.
    Returns: [B, T] x's dtype: the sequence mean at valid tokens, 0 elsewhere. Differentiable in x.
    """
    valid = jnp.asarray(mask).astype(bool)
    xv = jnp.where(valid, x, 0.0)
    if segment_ids is None:
        mean = safe_div(xv.sum(axis=-1), valid.sum(axis=-1).astype(x.dtype))[:, None]
        return jnp.where(valid, mean, 0.0)
    b, t = x.shape
    # One bucket per (row, segment id): ids lie in [0, T], so row * (T + 1) + id never collides.
    flat = (jnp.arange(b)[:, None] * (t + 1) + segment_ids.astype(jnp.int32)).reshape(-1)
    n = b * (t + 1)
    sums = jax.ops.segment_sum(xv.reshape(-1), flat, num_segments=n)
    counts = jax.ops.segment_sum(valid.reshape(-1).astype(x.dtype), flat, num_segments=n)
    mean = safe_div(sums, counts)[flat].reshape(b, t)
    return jnp.where(valid, mean, 0.0)
