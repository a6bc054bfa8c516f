"""The per-slot fields of a DecodeState: host-side settings of a request, and the pure writes that arm and
free slots. Shared by the dense :class:`~areal_jax.sampler.engine.Engine` and the paged engine, which differ
only in their caches."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.sampler.sampling import SamplingParams
from areal_jax.sampler.state import DecodeState, SlotSettings


def slot_settings(sampling: SamplingParams, max_stop_tokens: int) -> SlotSettings:
    """Device-ready settings of one request (numpy scalars, so no compile per value); stop ids padded with
    -1 to [max_stop_tokens]. ValueError when the request has more stop ids than that."""
    stops = sampling.stop_token_ids
    if len(stops) > max_stop_tokens:
        raise ValueError(
            f"{len(stops)} stop token ids given but the engine holds at most {max_stop_tokens}; "
            "build the Engine with a larger max_stop_tokens."
        )
    stop_ids = np.full((max_stop_tokens,), -1, np.int32)
    stop_ids[: len(stops)] = stops
    return SlotSettings(
        temperature=np.float32(sampling.temperature),
        top_k=np.int32(sampling.top_k_value),
        top_p=np.float32(sampling.top_p_value),
        max_new=np.int32(sampling.max_new_tokens),
        stop_ids=stop_ids,
    )


def empty_decode_state(cache: Any, vocab_size: int, num_slots: int, max_stop_tokens: int,
                       standby: DecodeState | None = None) -> DecodeState:
    """A DecodeState around ``cache`` with every one of the ``num_slots`` slots free (done) and zeroed (and
    ``standby``, an empty DecodeState of its own rows, or None)."""
    s = num_slots
    return DecodeState(
        cache=cache,
        logits=jnp.zeros((s, vocab_size), jnp.float32),
        lengths=jnp.zeros((s,), jnp.int32),
        last_tokens=jnp.zeros((s,), jnp.int32),
        done=jnp.ones((s,), bool),
        generated=jnp.zeros((s,), jnp.int32),
        max_new=jnp.zeros((s,), jnp.int32),
        temperature=jnp.ones((s,), jnp.float32),
        top_k=jnp.zeros((s,), jnp.int32),
        top_p=jnp.ones((s,), jnp.float32),
        stop_ids=jnp.full((s, max_stop_tokens), -1, jnp.int32),
        placements=jnp.zeros((s,), jnp.int32),
        standby=standby,
    )


def arm_slots(state: DecodeState, logits: jax.Array, lengths: jax.Array, last_tokens: jax.Array,
              idx: jax.Array, settings: SlotSettings, mode: str | None) -> DecodeState:
    """Arm slot(s) ``idx`` (a scalar, or [R] with out-of-range padding dropped under mode="drop") to decode:
    next-token logits [V] or [R, V] float32, cache lengths and last tokens, a fresh budget and ``settings``.
    The cache itself is written by the caller."""

    def put(arr: jax.Array, value: jax.Array) -> jax.Array:
        return arr.at[idx].set(value, mode=mode)

    return dataclasses.replace(
        state,
        logits=put(state.logits, logits),
        lengths=put(state.lengths, lengths),
        last_tokens=put(state.last_tokens, last_tokens),
        done=put(state.done, False),
        generated=put(state.generated, 0),
        max_new=put(state.max_new, settings.max_new),
        temperature=put(state.temperature, settings.temperature),
        top_k=put(state.top_k, settings.top_k),
        top_p=put(state.top_p, settings.top_p),
        stop_ids=put(state.stop_ids, settings.stop_ids),
    )


def free_slots(state: DecodeState, free: jax.Array) -> DecodeState:
    """Mark the slots where ``free`` ([S] bool) is True as done, so later steps leave them alone."""
    return dataclasses.replace(state, done=state.done | free)


def release_slots(state: DecodeState, free: jax.Array, placements: jax.Array) -> DecodeState:
    """``free_slots`` for the slots whose placement count still equals ``placements`` ([S] int32, what the host
    knew when it asked): a slot a standby row moved into since (inside a dispatch the host had not fetched)
    holds another request now and keeps running."""
    return free_slots(state, free & (state.placements == placements))


def place_standby(state: DecodeState,
                  write_cache: Callable[[Any, Any, jax.Array, jax.Array], Any]) -> tuple[DecodeState, jax.Array]:
    """Move the standby's waiting rows into free slots: waiting row number i (in row order) takes the i-th
    free slot (in slot order), as far as free slots go.

    write_cache(cache, standby cache, targets [R], lengths [R]) writes standby row j's cache (lengths[j]
    positions) into slot targets[j] (an out-of-range target, S, is dropped). Returns (state, targets [R] int32: the slot each row moved into, S
    where it did not). The moved rows are armed exactly as an insert would arm them and leave the standby.

    Branch-free: every step scatters all R rows, those that do not move to no slot (dropped), so the step holds
    no data-dependent control flow (on GPUs a ``lax.cond`` waits for the device).
    """
    sb = state.standby
    s, r = state.done.shape[0], sb.done.shape[0]
    waiting = ~sb.done
    free = jnp.nonzero(state.done, size=r, fill_value=s)[0].astype(jnp.int32)
    rank = jnp.cumsum(waiting.astype(jnp.int32)) - 1
    target = jnp.where(waiting, free[jnp.clip(rank, 0, r - 1)], s).astype(jnp.int32)
    moved = target < s
    settings = SlotSettings(temperature=sb.temperature, top_k=sb.top_k, top_p=sb.top_p, max_new=sb.max_new,
                            stop_ids=sb.stop_ids)
    armed = arm_slots(dataclasses.replace(state, cache=write_cache(state.cache, sb.cache, target, sb.lengths)), sb.logits,
                      sb.lengths, sb.last_tokens, target, settings, mode="drop")
    return dataclasses.replace(armed, placements=armed.placements.at[target].add(1, mode="drop"),
                               standby=dataclasses.replace(sb, done=sb.done | moved)), target
