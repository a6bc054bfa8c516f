"""Staleness control: admission of new rollouts and filtering of stale tokens.

Versions. Parameters of version v generate tokens tagged v. The trainer at version v trains one batch
and then publishes version v + 1. The staleness of a token trained at trainer version v is
v - (its tag); a sample's staleness is that of its oldest valid token.

Admission (AReaL's rule). With batch size B and bound eta, a rollout may start only while
    accepted + running < (eta + v + 1) * B,
where accepted counts every sample finished so far (including those already trained) and running the
ones in flight. If the trainer consumes samples in admission order (batch k is samples k*B .. k*B+B-1),
a sample admitted at version v' has admission index n < (eta + v' + 1) * B, so it sits in a batch
k <= eta + v' and is trained at version k: its staleness is at most eta, and eta = 0 is synchronous RL.
If instead batches are filled in completion order, a slow sample can be overtaken again and again and
exceed eta; ``staleness_mask`` then drops what is too old, which is what keeps the bound exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
STALENESS_UNITS: tuple[str, ...] = ("token", "sample")


def _check_nonneg_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int (got {value!r}).")


def rollout_capacity(version: int, batch_size: int, max_staleness: int | None, accepted: int,
                     running: int, max_concurrent: int | None) -> int:
    """How many more rollouts may be admitted now (host-side python ints).

    capacity = min((max_staleness + version + 1) * batch_size - (accepted + running),
                   max_concurrent - running), floored at 0.
    max_staleness None drops the staleness term (no bound on off-policyness); max_concurrent None drops
    the concurrency term. Both None raises ValueError, because the capacity would be unbounded and a
    controller would admit rollouts without end.

    Args:
      version: the trainer's current parameter version v (>= 0).
      batch_size: samples per training step B (>= 1).
      max_staleness: eta >= 0, or None.
      accepted: samples finished so far, including those already trained (>= 0).
      running: rollouts in flight (>= 0).
      max_concurrent: the most rollouts in flight at once (>= 1), or None.
    """
    for name, value in (("version", version), ("accepted", accepted), ("running", running)):
        _check_nonneg_int(name, value)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (got {batch_size!r}).")
    if max_staleness is None and max_concurrent is None:
        raise ValueError("rollout_capacity needs max_staleness or max_concurrent: with both None the "
                         "number of rollouts to admit is unbounded. Set max_staleness (eta, e.g. 4; "
                         "0 is synchronous RL) or max_concurrent.")
    bounds = []
    if max_staleness is not None:
        _check_nonneg_int("max_staleness", max_staleness)
        bounds.append((max_staleness + version + 1) * batch_size - (accepted + running))
    if max_concurrent is not None:
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"max_concurrent must be a positive int or None (got {max_concurrent!r}).")
        bounds.append(max_concurrent - running)
    return max(0, min(bounds))


def sample_staleness(trainer_version: int | Array, token_versions: Array, mask: Array) -> Array:
    """trainer_version minus the oldest version among each sample's valid tokens.

    trainer_version: [] int. token_versions: [B, T] int, the version that produced each token.
    mask: [B, T] float or bool. Returns [B] int32; 0 for a sample without valid tokens.
    """
    versions = jnp.asarray(token_versions).astype(jnp.int32)
    valid = jnp.asarray(mask).astype(bool)
    big = jnp.iinfo(jnp.int32).max
    oldest = jnp.min(jnp.where(valid, versions, big), axis=-1)
    has_valid = valid.any(axis=-1)
    return jnp.where(has_valid, jnp.asarray(trainer_version, jnp.int32) - oldest, 0)


def staleness_mask(token_versions: Array, trainer_version: int | Array, max_staleness: int | None,
                   mask: Array, *, per: str = "token") -> Array:
    """The loss mask with stale tokens removed: version < trainer_version - max_staleness is stale.

    per="token" zeroes only the stale tokens; per="sample" zeroes every token of a sample holding any
    stale valid token. max_staleness None returns mask unchanged. Feed the result to a loss as its mask.

    token_versions: [B, T] int; trainer_version: [] int; mask: [B, T] float or bool.
    Returns [B, T] with mask's dtype.
    """
    if per not in STALENESS_UNITS:
        raise ValueError(f"per={per!r} is unknown; use one of {STALENESS_UNITS}.")
    mask = jnp.asarray(mask)
    if max_staleness is None:
        return mask
    _check_nonneg_int("max_staleness", max_staleness)
    versions = jnp.asarray(token_versions).astype(jnp.int32)
    valid = mask.astype(bool)
    oldest_allowed = jnp.asarray(trainer_version, jnp.int32) - max_staleness
    stale = valid & (versions < oldest_allowed)
    if per == "sample":
        stale = jnp.broadcast_to(stale.any(axis=-1, keepdims=True), stale.shape)
    return jnp.where(stale, jnp.zeros_like(mask), mask)
