"""k decode steps in one dispatch: a ``lax.while_loop`` around the engine's single step.

Per-step host work (dispatch, a device-to-host fetch, Python bookkeeping) dominates a decode step of
a real model on an accelerator: the step itself only reads the weights and the live KV cache once.
Running k steps inside one compiled program moves the stop-token, length and sampling checks onto the
device (they already live in the :class:`DecodeState`) and leaves one dispatch and one fetch per k
tokens. The loop ends early when every slot has finished, so a short tail costs no idle steps.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from areal_jax.sampler.state import DecodeState, MultiStepResult, StepResult

StepFn = Callable[[DecodeState, jax.Array], tuple[DecodeState, StepResult]]


def run_decode_steps(step: StepFn, state: DecodeState, keys: jax.Array) -> tuple[DecodeState, MultiStepResult]:
    """Run ``step`` up to K times, stopping once every slot is done.

    Args:
      step: one decode step, (state, raw key data [2] uint32) -> (state, StepResult); pure.
      state: the decode state (S slots).
      keys: [K, 2] uint32 raw key data, one key per step (step t uses ``keys[t]``, so K calls of the
        single step with the same keys draw the same tokens).

    Returns:
      (state after the last step that ran, MultiStepResult with [K, S] buffers; rows of steps that
      did not run are invalid).
    """
    k, s = keys.shape[0], state.done.shape[0]
    buffers = (jnp.zeros((k, s), jnp.int32), jnp.zeros((k, s), jnp.float32), jnp.zeros((k, s), bool))

    def cond(carry: tuple) -> jax.Array:
        t, state, _ = carry
        return (t < k) & ~jnp.all(state.done)

    def body(carry: tuple) -> tuple:
        t, state, (tokens, logprobs, valid) = carry
        state, r = step(state, keys[t])
        return t + 1, state, (tokens.at[t].set(r.tokens), logprobs.at[t].set(r.logprobs), valid.at[t].set(r.valid))

    steps, state, (tokens, logprobs, valid) = jax.lax.while_loop(cond, body, (jnp.int32(0), state, buffers))
    return state, MultiStepResult(tokens=tokens, logprobs=logprobs, valid=valid, done=state.done, steps=steps)
