"""k decode steps in one dispatch: a loop of k trips around the engine's single step.

Per-step host work (dispatch, a device-to-host fetch, Python bookkeeping) dominates a decode step of
a real model on an accelerator: the step itself only reads the weights and the live KV cache once.
Running k steps inside one compiled program moves the stop-token, length and sampling checks onto the
device (they already live in the :class:`DecodeState`) and leaves one dispatch and one fetch per k
tokens.

The loop always runs k trips, also after every slot has finished (those steps write nothing anyone reads and
count in no result): a loop that ends on a value computed on the device is, on GPUs, a device-to-host copy and a
wait for the whole stream before every trip (XLA's WhileThunk), while a known trip count lets the host queue
all k steps at once. Nothing inside a step branches on data either (``sampling.SamplingFilters``,
``slots.place_standby``), so the dispatch never stops the stream.

With a standby (prefilled requests waiting on the device, ``DecodeState.standby``), a slot that finishes
inside the dispatch takes the next waiting request before the following step, instead of idling until
the host admits one between dispatches (up to two dispatches later with fetch-behind).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from areal_jax.sampler.state import DecodeState, MultiStepResult, StepResult

StepFn = Callable[[DecodeState, jax.Array], tuple[DecodeState, StepResult]]
PlaceFn = Callable[[DecodeState], tuple[DecodeState, jax.Array]]


def run_decode_steps(step: StepFn, state: DecodeState, keys: jax.Array,
                     place: PlaceFn | None = None) -> tuple[DecodeState, MultiStepResult]:
    """Run ``step`` K times (a loop with a static trip count).

    Args:
      step: one decode step, (state, raw key data [2] uint32) -> (state, StepResult); pure.
      state: the decode state (S slots).
      keys: [K, 2] uint32 raw key data, one key per step (step t uses ``keys[t]``, so K calls of the
        single step with the same keys draw the same tokens).
      place: with a standby in ``state``: (state) -> (state with standby rows moved into free slots,
        [R] int32 slot of each row, S where none), run before every step (``slots.place_standby``).

    Returns:
      (state after the K steps, MultiStepResult with [K, S] buffers; ``steps`` counts the steps in which some
      slot decoded, a prefix of the K: once every slot is done and the standby empty, none decodes again).
    """
    k, s = keys.shape[0], state.done.shape[0]
    r = 0 if state.standby is None or place is None else state.standby.done.shape[0]
    buffers = (jnp.zeros((k, s), jnp.int32), jnp.zeros((k, s), jnp.float32), jnp.zeros((k, s), bool))
    placed = (jnp.full((r,), s, jnp.int32), jnp.zeros((r,), jnp.int32))

    def body(carry: tuple) -> tuple:
        t, state, (tokens, logprobs, valid), (slot_of, step_of) = carry
        if r:
            state, target = place(state)
            moved = target < s
            slot_of, step_of = jnp.where(moved, target, slot_of), jnp.where(moved, t, step_of)
        state, out = step(state, keys[t])
        buffers = (tokens.at[t].set(out.tokens), logprobs.at[t].set(out.logprobs), valid.at[t].set(out.valid))
        return t + 1, state, buffers, (slot_of, step_of)

    # A counter-only condition: XLA reads the trip count off it (no scan: its lowering held two more [S, V] buffers)
    _, state, (tokens, logprobs, valid), (slot_of, step_of) = jax.lax.while_loop(
        lambda carry: carry[0] < k, body, (jnp.int32(0), state, buffers, placed))
    steps = jnp.sum(jnp.any(valid, axis=1), dtype=jnp.int32)
    return state, MultiStepResult(tokens=tokens, logprobs=logprobs, valid=valid, done=state.done, steps=steps,
                                  placed_slot=slot_of, placed_step=step_of)
