"""The pytrees the engine passes around: decode state, prefilled prompts, step results."""
from __future__ import annotations

import dataclasses

import jax

from areal_jax.models import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the decode step reads and writes, one row per slot (S = num_slots).

    Attributes:
      cache: KVCache with k, v: L layers of [S, max_len, kv_heads, head_dim] (compute dtype).
      logits: [S, V] float32 logits of the next token each slot will sample.
      lengths: [S] int32 tokens already in the cache (prompt + generated); the next token is
        written at this index.
      last_tokens: [S] int32 the last token of each slot's sequence.
      done: [S] bool; True for free slots and for slots whose request finished.
      generated: [S] int32 tokens generated since the slot was (re)inserted.
      max_new: [S] int32 budget of new tokens since the slot was (re)inserted.
      temperature: [S] float32 (0 = greedy); top_k: [S] int32 (0 = off); top_p: [S] float32.
      stop_ids: [S, max_stop_tokens] int32 stop token ids, padded with -1.
      placements: [S] int32 standby rows moved into each slot so far (``slots.place_standby``); the host
        passes the count it knows of with a release, which then spares a slot a row has moved into since.
      standby: None, or a DecodeState of R rows (cache [R, standby_len], or over pages its page-table rows
        [R, pages per slot]; no standby of its own) holding prefilled requests that wait on the device: a
        multi-step decode moves each into a slot as soon as one is free (``slots.place_standby``), inside the
        dispatch. ``done`` marks its empty rows.
    """

    cache: KVCache
    logits: jax.Array
    lengths: jax.Array
    last_tokens: jax.Array
    done: jax.Array
    generated: jax.Array
    max_new: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    stop_ids: jax.Array
    placements: jax.Array
    standby: "DecodeState | None" = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """A prefilled prompt, ready to be inserted into one or more slots.

    Attributes:
      cache: KVCache with k, v: L layers of [1, P, kv_heads, head_dim], P = the prompt's bucket; rows at
        index >= true_length hold padding junk that decoding overwrites before reading.
      logits: [V] float32 logits of the first token to generate.
      logprobs: [V] float32 log-softmax of ``logits`` (the unfiltered first-token distribution).
      true_length: [] int32 number of real prompt tokens.
      last_token: [] int32 the last prompt token.
      routes: None, or (``Engine.prefill_many(routes=True)``, a mixture-of-experts model) [P, L_moe, k] the experts
        the prefill sent each prompt position to (`moe.routes_dtype`; rows past true_length: padding).
    """

    cache: KVCache
    logits: jax.Array
    logprobs: jax.Array
    true_length: jax.Array
    last_token: jax.Array
    routes: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepResult:
    """What one decode step hands to the host (fetched once per step; S = num_slots).

    Attributes:
      tokens: [S] int32 token sampled for each slot (meaningless where ``valid`` is False).
      logprobs: [S] float32 behaviour log-probability of each token.
      done: [S] bool; True where the slot is free or its request has finished (after this step).
      valid: [S] bool; True where the slot was generating when the step began, i.e. the token is real.
      routes: None, or (routes=True, a mixture-of-experts model) [S, L_moe, k] the experts the step sent each slot's
        token to (`moe.routes_dtype`; the token is fed to the model in the step that samples it).
    """

    tokens: jax.Array
    logprobs: jax.Array
    done: jax.Array
    valid: jax.Array
    routes: jax.Array | None = None

    def to_host(self) -> "StepResult":
        """The same result as numpy arrays, in one device-to-host transfer."""
        return StepResult(*jax.device_get(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotSettings:
    """Per-request settings as device arrays, so one compiled insert serves every request.

    Shapes are [] (one request) or [R] (one per inserted row); stop_ids adds a trailing
    [max_stop_tokens] axis padded with -1.
    """

    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32, 1 = off
    max_new: jax.Array  # int32
    stop_ids: jax.Array  # int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MultiStepResult:
    """What one multi-step dispatch hands to the host (K = steps per dispatch, S = num_slots).

    Attributes:
      tokens: [K, S] int32 token of step t for each slot (meaningless where ``valid`` is False).
      logprobs: [K, S] float32 behaviour log-probabilities of ``tokens``.
      valid: [K, S] bool; True where the slot was generating when step t began. Per slot the valid
        steps are a prefix of the K (a finished slot stays finished for the rest of the dispatch).
      done: [S] bool after the last step that ran.
      steps: [] int32 steps that ran (< K when every slot finished early).
      placed_slot: [R] int32, R = standby rows (0 without a standby): the slot standby row j moved into
        during the dispatch, S where it did not move.
      placed_step: [R] int32: the step it moved before (its first valid step; the slot's earlier steps
        belong to the slot's previous occupants). A slot's valid steps are a prefix of each occupant's span.
      routes: None, or (routes=True) [K, S, L_moe, k]: ``StepResult.routes`` of each step.
    """

    tokens: jax.Array
    logprobs: jax.Array
    valid: jax.Array
    done: jax.Array
    steps: jax.Array
    placed_slot: jax.Array
    placed_step: jax.Array
    routes: jax.Array | None = None

    def to_host(self) -> "MultiStepResult":
        """The same result as numpy arrays, in one device-to-host transfer."""
        return MultiStepResult(*jax.device_get(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))
