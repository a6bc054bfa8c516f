"""k decode steps in one dispatch: a loop around the engine's single step.

Per-step host work (dispatch, a device-to-host fetch, Python bookkeeping) dominates a decode step of
a real model on an accelerator: the step itself only reads the weights and the live KV cache once.
Running k steps inside one compiled program moves the stop-token, length and sampling checks onto the
device (they already live in the :class:`DecodeState`) and leaves one dispatch and one fetch per k
tokens.

Nothing inside a step branches on data (``sampling.SamplingFilters``, ``slots.place_standby``): on GPUs XLA runs a
``lax.cond`` by copying its predicate to the host and waiting for the whole stream (XLA's ConditionalThunk), and a
``while`` whose trip count it cannot read off the condition the same way before every trip (WhileThunk). So on
GPUs (``counted=True``) the loop always runs its k trips, also after every slot has finished (those steps write
only junk nobody reads and count in no result), and the host queues all k steps at once. Elsewhere the loop ends
once every slot is done and the standby is empty: the CPU evaluates the condition on the host anyway, a TPU on the
device, so a short tail costs no idle steps there.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from areal_jax.sampler.state import DecodeState, MultiStepResult, StepResult

StepFn = Callable[[DecodeState, jax.Array], tuple[DecodeState, StepResult]]
PlaceFn = Callable[[DecodeState], tuple[DecodeState, jax.Array]]


def run_decode_steps(step: StepFn, state: DecodeState, keys: jax.Array, place: PlaceFn | None = None,
                     counted: bool = False, routes: jax.ShapeDtypeStruct | None = None) -> tuple[DecodeState, MultiStepResult]:
    """Run ``step`` K times, or (``counted`` False) until every slot is done and the standby empty.

    Args:
      step: one decode step, (state, raw key data [2] uint32) -> (state, StepResult); pure.
      state: the decode state (S slots).
      keys: [K, 2] uint32 raw key data, one key per step (step t uses ``keys[t]``, so K calls of the
        single step with the same keys draw the same tokens).
      place: with a standby in ``state``: (state) -> (state with standby rows moved into free slots,
        [R] int32 slot of each row, S where none), run before every step (``slots.place_standby``).
      counted: always K trips, a trip count XLA reads off the loop (see the module docstring).
      routes: one token's [L_moe, k] shape and dtype when ``step`` records each slot's experts (``StepResult.routes``).

    Returns:
      (state after the last trip, MultiStepResult with [K, S] buffers (and [K, S, L_moe, k] routes when the step
      records them), invalid in the steps no slot decoded;
      ``steps`` counts the steps in which some slot decoded, a prefix of the K: once every slot is done and the
      standby empty, none decodes again).
    """
    k, s = keys.shape[0], state.done.shape[0]
    r = 0 if state.standby is None or place is None else state.standby.done.shape[0]
    buffers = (jnp.zeros((k, s), jnp.int32), jnp.zeros((k, s), jnp.float32), jnp.zeros((k, s), bool))
    buffers += () if routes is None else (jnp.zeros((k, s, *routes.shape), routes.dtype),)
    placed = (jnp.full((r,), s, jnp.int32), jnp.zeros((r,), jnp.int32))

    def body(carry: tuple) -> tuple:
        t, state, buffers, (slot_of, step_of) = carry
        if r:
            state, target = place(state)
            moved = target < s
            slot_of, step_of = jnp.where(moved, target, slot_of), jnp.where(moved, t, step_of)
        state, out = step(state, keys[t])
        fields = (out.tokens, out.logprobs, out.valid) + (() if routes is None else (out.routes,))
        return t + 1, state, tuple(b.at[t].set(x) for b, x in zip(buffers, fields)), (slot_of, step_of)

    def more(carry: tuple) -> jax.Array:
        t, state, _, _ = carry
        if counted:
            return t < k  # a counter-only condition: XLA reads the trip count off it
        idle = jnp.all(state.done) & (jnp.all(state.standby.done) if r else True)
        return (t < k) & ~idle

    _, state, (tokens, logprobs, valid, *recorded), (slot_of, step_of) = jax.lax.while_loop(
        more, body, (jnp.int32(0), state, buffers, placed))
    steps = jnp.sum(jnp.any(valid, axis=1), dtype=jnp.int32)
    return state, MultiStepResult(tokens=tokens, logprobs=logprobs, valid=valid, done=state.done, steps=steps,
                                  placed_slot=slot_of, placed_step=step_of, routes=recorded[0] if recorded else None)
