"""The decode engine: JetStream's engine API shape (prefill / insert / generate), pure and jitted.

A fixed number of *slots* decode together. Each slot owns one row of a KV cache (per layer
``[num_slots, max_len, kv_heads, head_dim]``) plus its next-token logits and sampling settings.
One call of :meth:`Engine.generate` advances every slot by one token with a single compiled program:

1. sample a token per slot from the slot's stored logits (its behaviour logprob comes with it);
2. run the model on those tokens (writing their keys / values into the cache) to get the logits of
   the following token.

Storing the logits in the state means a prefilled prompt only has to be *inserted*; several slots
holding the same prefix (a GRPO group, :meth:`Engine.bulk_insert`) then draw different first tokens.
All functions take ``params`` = the ``nnx.State`` of ``nnx.split(model)``, or the same held flat
(:class:`~areal_jax.models.FlatParams`, what :meth:`Engine.place_params` returns: about 0.8 ms less host
time per dispatch at a few hundred leaves); the decode state is donated so a step rewrites the cache in
place. Prompts are padded to power-of-two buckets so a run compiles a handful of programs.
:meth:`Engine.prefill_many` prefills the prompts at the head of the loop's queue in batched calls, once
per distinct prompt; :meth:`Engine.insert_sequences` prefills and inserts many sequences at once (the
re-prefill of in-flight sequences after a weight update). The per-slot fields are in ``sampler.slots``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models import FlatParams, KVCache, ModelConfig, as_tree, init_cache, logical_to_mesh_sharding
from areal_jax.models.cache_attention import counted_decode_loops, ragged_decode_calls
from areal_jax.models.config import model_config_of
from areal_jax.models.mla import cache_layout
from areal_jax.sampler import decode_choice
from areal_jax.sampler import prefill as _prefill
from areal_jax.sampler.config import default_buckets
from areal_jax.sampler.introspect import CountedPrograms
from areal_jax.sampler.multistep import run_decode_steps
from areal_jax.sampler.prefill import insert_sequences, last_tokens, prefill_rows, row_prefixes, write_rows
from areal_jax.sampler.routes import token_routes
from areal_jax.sampler.sampling import NO_FILTERS, SamplingFilters, SamplingParams, sample_tokens
from areal_jax.sampler.slots import arm_slots, empty_decode_state, release_slots, slot_settings
from areal_jax.sampler.standby import StandbyRows, padded_indices, standby_size
from areal_jax.sampler.state import DecodeState, MultiStepResult, Prefix, SlotSettings, StepResult


class Engine(StandbyRows, CountedPrograms):
    """Pure, jitted prefill / insert / generate over a fixed set of decode slots."""

    def __init__(
        self,
        model_graphdef_or_model: nnx.Module | nnx.GraphDef,
        *,
        num_slots: int,
        max_len: int,
        mesh: Mesh | None = None,
        prefill_buckets: Sequence[int] | None = None,
        config: ModelConfig | None = None,
        max_stop_tokens: int = 8,
        min_bucket: int = 16,
        prefill_batch: int = 8,
        prefill_tokens: int = _prefill.PREFILL_TOKENS,
        standby_rows: int = 0,
        standby_len: int | None = None,
        counted_loop: bool | None = None,
        ring_cache: bool = True,
        decode_attention: str = "auto",
    ) -> None:
        """Build the engine.

        Args:
          model_graphdef_or_model: a Transformer (its graphdef and config are taken) or the
            graphdef of ``nnx.split(model)`` (then ``config`` is required).
          num_slots: sequences decoded together by one step.
          max_len: longest sequence (prompt + generated tokens) a slot can hold.
          mesh: optional rollout mesh with axes ("fsdp", "tensor"); params are sharded with the
            model's logical rules and the cache over kv_heads on "tensor" when divisible.
          prefill_buckets: padded prompt lengths (increasing, each <= max_len); default powers of
            two from ``min_bucket`` plus max_len.
          config: the ModelConfig, needed when a graphdef is given.
          max_stop_tokens: the most stop token ids one request may carry.
          prefill_batch: rows per batched prefill call of :meth:`insert_sequences` and
            :meth:`prefill_many`, at most; prefill_tokens: padded tokens per call, at most (fewer rows for
            long buckets, at least one: the call's activations and the rows' cache before they are written
            grow with rows x bucket; ``prefill_rows_for``).
          standby_rows, standby_len: prefilled requests that can wait on the device for a slot, and the
            longest prompt bucket each holds (default min(max_len, 512)); see ``sampler.standby``.
          counted_loop: run every k-step dispatch for all k steps (``sampler.multistep``), and its attention over
            every chunk of a cache longer than one (``cache_attention.counted_decode_loop``); default on GPUs, where ending
            a loop early costs the host a wait for the device before every trip.
          ring_cache: a sliding-window layer's slots hold only its window, as rings (``init_cache(ring=True)``),
            instead of max_len positions: Gemma 3's 5 sliding layers of 6 at window 512 and max_len 8,192 then
            hold 19% of the dense cache. Prompts are still prefilled into full-length rows, then copied in.
          decode_attention: "xla" (``cached_attention``: every cache position on GPUs), "kernel" (``ragged_decode``: rows
            up to their lengths) or "auto" (the faster, timed on GPUs, else XLA; ``decode_choice`` says what it took).
        """
        if isinstance(model_graphdef_or_model, nnx.Module):
            self.config = config or model_config_of(model_graphdef_or_model)
            self.graphdef = nnx.graphdef(model_graphdef_or_model)
        else:
            if config is None:
                raise ValueError("Engine was given a graphdef without config=: pass the ModelConfig too.")
            self.config, self.graphdef = config, model_graphdef_or_model
        if num_slots < 1 or max_len < 2:
            raise ValueError(f"Engine needs num_slots >= 1 and max_len >= 2, got {num_slots} and {max_len}.")
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit and max_len > limit:
            raise ValueError(f"max_len={max_len} exceeds the model's max_position_embeddings={limit}; lower max_len.")
        self.num_slots, self.max_len, self.mesh = int(num_slots), int(max_len), mesh
        self.ring_cache = bool(ring_cache) and self.config.sliding_window is not None
        self._reset_placements()
        self.max_stop_tokens = int(max_stop_tokens)
        self.standby_rows, self.standby_len = standby_size(standby_rows, standby_len, self.max_len)
        self.prefill_batch = max(1, min(int(prefill_batch), self.num_slots))
        self.prefill_tokens = int(prefill_tokens)
        buckets = tuple(int(b) for b in (prefill_buckets or default_buckets(max_len, min_bucket)))
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] > max_len:
            raise ValueError(
                f"prefill_buckets must be strictly increasing lengths in [1, max_len={max_len}], got {buckets}."
            )
        self.prefill_buckets = buckets
        self._compiles = 0
        self.sampling_filters = NO_FILTERS  # what the requests seen so far need (``settings``)
        self.counted_loop = jax.default_backend() == "gpu" if counted_loop is None else bool(counted_loop)
        self.decode_choice = decode_choice.resolve(decode_attention, self.config, self.num_slots, self.max_len, mesh)
        self.decode_attention = self.decode_choice.path
        self._placement: tuple[Any, list] | None = None  # (params treedef, its leaves' shardings on the mesh)
        self._state_sharding = None
        self._prefix_sharding = None
        if mesh is not None:
            self._setup_shardings()
        self._jit_prefill = jax.jit(self._prefill_fn, out_shardings=self._prefix_sharding)
        self._jit_prefill_many: dict[tuple[int, bool], Callable[..., Any]] = {}  # (rows, routes) -> program
        self._jit_trim = jax.jit(_prefill.trim_prefix, static_argnums=1, out_shardings=self._prefix_sharding)
        self._prefill_many_shapes: set[tuple[int, int]] = set()  # (rows, bucket) already compiled
        self._jit_init = jax.jit(self._init_fn, out_shardings=self._state_sharding)
        self._build_state_programs()

    def _build_state_programs(self) -> None:
        """(Re)build every jitted program that takes the decode state, each through `_state_program` (the hook a
        subclass overrides to add a step to all of them: the paged engine's page table)."""
        self._jit_insert = self._state_program(self._insert_fn, 1)
        self._jit_bulk_insert = self._state_program(self._bulk_insert_fn, 1)
        self._jit_prefill_insert = self._state_program(self._prefill_insert_fn, 1)
        self._jit_release = self._state_program(self._release_fn, 0)
        self._jit_generate = self._state_program(self._generate_fn, 1, ("filters",), result=True)
        self._jit_generate_steps = self._state_program(self._generate_steps_fn, 1, ("filters", "routes"), result=True)
        self._jit_stage = self._state_program(self._stage_fn, 1)
        self._jit_release_standby = self._state_program(self._release_standby_fn, 0)

    def _state_program(self, fn: Callable[..., Any], at: int, static: tuple[str, ...] = (),
                       result: bool = False) -> Callable[..., Any]:
        """`fn` jitted as a state program: it donates the decode state (positional argument `at`) and returns the
        new one laid out as the engine's, alone or (result) first of a pair."""
        out = (self._state_sharding, None) if result else self._state_sharding
        return jax.jit(fn, donate_argnums=(at,), static_argnames=static, out_shardings=out)

    # ----------------------------------------------------------------------------- sharding
    def _cache_spec(self) -> PartitionSpec:
        tensor = self.mesh.shape.get("tensor", 1)
        if tensor > 1 and cache_layout(self.config)[0] % tensor == 0:
            return PartitionSpec(None, None, "tensor", None)
        return PartitionSpec()

    def _cache_sharding(self, cache: Any) -> Any:
        """Shardings of a state's cache field of these shapes: every array by `_cache_spec` ([rows, positions, kv
        heads, head_dim] arrays)."""
        sharding = NamedSharding(self.mesh, self._cache_spec())
        return jax.tree.map(lambda _: sharding, cache)

    def _setup_shardings(self) -> None:
        rows = NamedSharding(self.mesh, Engine._cache_spec(self))  # a prefill's rows: kv heads over tensor
        replicated = NamedSharding(self.mesh, PartitionSpec())

        shapes = jax.eval_shape(self._init_fn)
        self._state_sharding = dataclasses.replace(
            jax.tree.map(lambda _: replicated, shapes),
            cache=self._cache_sharding(shapes.cache),
            standby=self.standby_sharding(shapes, self._cache_sharding, replicated))
        self._prefix_sharding = Prefix(KVCache(k=rows, v=rows), replicated, replicated, replicated, replicated)

    def place_params(self, params: nnx.State | FlatParams) -> FlatParams:
        """``params`` held flat (FlatParams) and, with a mesh, laid out with the model's sharding; leaves
        already laid out so are kept as they are."""
        flat = FlatParams.of(params)
        if self.mesh is None:
            return flat
        if self._placement is None or self._placement[0] != flat.treedef:
            # From the params' own logical axes, so the shardings line up leaf by leaf with these params.
            self._placement = (flat.treedef, jax.tree.leaves(logical_to_mesh_sharding(flat.tree(), self.mesh)))
        return flat.laid_out(self._placement[1])

    # ----------------------------------------------------------------------------- pure functions
    def _init_fn(self) -> DecodeState:
        cache = init_cache(self.config, self.num_slots, self.max_len, ring=self.ring_cache)
        return empty_decode_state(cache, self.config.vocab_size, self.num_slots, self.max_stop_tokens,
                                  self._standby_state())

    def _prefill_rows(self, params: nnx.State, tokens: jax.Array, lengths: jax.Array, routes: bool = False) -> tuple:
        return prefill_rows(nnx.merge(self.graphdef, as_tree(params)), self.config, tokens, lengths, routes)

    def _prefill_fn(self, params: nnx.State, tokens: jax.Array, true_length: jax.Array) -> Prefix:
        return row_prefixes(*self._prefill_rows(params, tokens, true_length[None]), tokens, true_length[None])[0]

    def _prefill_many_fn(self, params: nnx.State, tokens: jax.Array, lengths: jax.Array,
                         routes: bool = False) -> tuple[Prefix, ...]:
        """tokens [R, P] (tail padded), lengths [R] -> R one-row Prefixes (each its own buffers)."""
        cache, logits, *picks = self._prefill_rows(params, tokens, lengths, routes)
        return row_prefixes(cache, logits, tokens, lengths, *(p.astype(token_routes(self.config).dtype) for p in picks))

    _set_slot_fields = staticmethod(arm_slots)

    def _insert_fn(self, prefix: Prefix, state: DecodeState, slot: jax.Array,
                   settings: SlotSettings) -> DecodeState:
        state = dataclasses.replace(state, cache=write_rows(state.cache, prefix.cache, slot[None], prefix.true_length))
        return self._set_slot_fields(state, prefix.logits, prefix.true_length, prefix.last_token, slot,
                                     settings, mode=None)

    def _bulk_insert_fn(self, prefix: Prefix, state: DecodeState, slots: jax.Array,
                        settings: SlotSettings) -> DecodeState:
        state = dataclasses.replace(state, cache=write_rows(state.cache, prefix.cache, slots, prefix.true_length))
        return self._set_slot_fields(state, prefix.logits, prefix.true_length, prefix.last_token, slots,
                                     settings, mode="drop")

    def _prefill_insert_fn(self, params: nnx.State, state: DecodeState, tokens: jax.Array,
                           lengths: jax.Array, slots: jax.Array, settings: SlotSettings) -> DecodeState:
        cache, logits = self._prefill_rows(params, tokens, lengths)
        state = dataclasses.replace(state, cache=write_rows(state.cache, cache, slots, lengths))
        return self._set_slot_fields(state, logits, lengths, last_tokens(tokens, lengths), slots, settings,
                                     mode="drop")

    def _generate_fn(self, params: nnx.State, state: DecodeState, rng: jax.Array,
                     filters: SamplingFilters = SamplingFilters(),
                     routes: bool = False) -> tuple[DecodeState, StepResult]:
        model = nnx.merge(self.graphdef, as_tree(params))
        if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)  # raw uint32 key data from the host
        tokens, logprobs = sample_tokens(state.logits, rng, state.temperature, state.top_k, state.top_p, filters)
        valid = ~state.done
        step = valid.astype(jnp.int32)
        positions = _prefill.held_positions(self.config, state.lengths, valid)
        lengths = state.lengths + step
        generated = state.generated + step
        is_stop = jnp.any(tokens[:, None] == state.stop_ids, axis=-1)
        finished = valid & (is_stop | (generated >= state.max_new) | (lengths >= self.max_len))
        logits, cache, *picks = self._decode_forward(model, tokens[:, None], positions[:, None], state.cache, routes)
        new_state = dataclasses.replace(state, cache=cache, logits=logits[:, 0].astype(jnp.float32), lengths=lengths,
                                        last_tokens=jnp.where(valid, tokens, state.last_tokens),
                                        done=state.done | finished, generated=generated)
        return new_state, StepResult(tokens=tokens, logprobs=logprobs, done=new_state.done, valid=valid,
                                     routes=picks[0][:, 0].astype(token_routes(self.config).dtype) if picks else None)

    def _decode_forward(self, model: nnx.Module, tokens: jax.Array, positions: jax.Array, cache: Any,
                        routes: bool = False) -> tuple:
        """tokens, positions [S, 1] -> (logits [S, 1, V] float32, new cache), and with routes the experts of each
        token, [S, 1, L_moe, k] int32: the model's cache path."""
        with ragged_decode_calls(self.decode_attention == "kernel", self.mesh, tiling=self.decode_choice.tiling):
            h, cache, *picks = model.hidden(tokens, positions, cache=cache, ring=self.ring_cache, record_routes=routes)
        return model.unembed(h), cache, *picks

    def _generate_steps_fn(self, params: nnx.State, state: DecodeState, keys: jax.Array,
                           filters: SamplingFilters = SamplingFilters(), routes: bool = False) -> tuple:
        with counted_decode_loops(self.counted_loop):  # the attention's cache loops agree with the k-step loop
            return run_decode_steps(lambda st, key: self._generate_fn(params, st, key, filters, routes), state, keys,
                                    self._place_fn, counted=self.counted_loop, routes=token_routes(self.config) if routes else None)

    _release_fn = staticmethod(release_slots)

    # ----------------------------------------------------------------------------- public API
    def settings(self, sampling: SamplingParams) -> SlotSettings:
        """Device-ready settings of one request (numpy scalars; no compile per value). Every request reaches the
        device through here, so this also widens ``sampling_filters``, the transforms the decode programs
        include: the first request using top-k, top-p or sampling at all compiles a program with it."""
        out = slot_settings(sampling, self.max_stop_tokens)
        self.sampling_filters = self.sampling_filters | SamplingFilters.of(sampling)
        return out

    def bucket_for(self, length: int) -> int:
        """Smallest prefill bucket holding ``length`` tokens; ValueError when none does."""
        for b in self.prefill_buckets:
            if b >= length:
                return b
        raise ValueError(
            f"A sequence of {length} tokens does not fit the largest prefill bucket "
            f"({self.prefill_buckets[-1]}); shorten the prompt or raise max_len / prefill_buckets."
        )

    def prefill_rows_for(self, bucket: int) -> int:
        """Rows of a batched prefill call at ``bucket``: prefill_batch, fewer when they exceed prefill_tokens."""
        return max(1, min(self.prefill_batch, self.prefill_tokens // int(bucket)))

    def init_decode_state(self) -> DecodeState:
        """A fresh state: zero cache, every slot free (done). The engine's host bookkeeping (the placements
        it knows of) starts over too: an engine serves one decode state at a time."""
        self._reset_placements()
        return self._call(self._jit_init)

    def prefill(self, params: nnx.State, tokens: Sequence[int] | np.ndarray,
                true_length: int | None = None) -> Prefix:
        """Run the prompt through the model once.

        Args:
          params: model state (from ``nnx.split``).
          tokens: [T] int prompt ids (entries past ``true_length`` are ignored); padded here to
            the smallest bucket >= true_length.
          true_length: number of real tokens (default ``len(tokens)``), >= 1.
        """
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n = int(tokens.shape[0] if true_length is None else true_length)
        if n < 1 or n > tokens.shape[0]:
            raise ValueError(f"prefill needs 1 <= true_length <= len(tokens), got {n} for {tokens.shape[0]} tokens.")
        padded = np.zeros((1, self.bucket_for(n)), np.int32)
        padded[0, :n] = tokens[:n]
        return self._call(self._jit_prefill, params, padded, np.int32(n))

    def prefill_many(self, params: nnx.State, prompts: Sequence[Sequence[int]], routes: bool = False) -> list[Prefix]:
        """:meth:`prefill` of several prompts in batched calls: one Prefix per prompt, in order.

        A call holds ``prefill_rows_for(bucket)`` rows (one row for a single prompt, unless only the full-width
        program of its bucket is compiled yet), padded to the bucket of its longest prompt, so admitting
        many prompts costs a few full matrix products instead of one thin product per prompt; a bucket
        compiles at most two programs. Each Prefix's cache is cut back to its own prompt's bucket
        (``prefill.prefill_many``). routes: a mixture-of-experts model's Prefixes carry the experts of each prompt
        position (``Prefix.routes``).
        """
        return _prefill.prefill_many(self, params, prompts, routes)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= int(slot) < self.num_slots:
            raise ValueError(f"slot {slot} is out of range for an engine with {self.num_slots} slots.")

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int,
               sampling: SamplingParams | None = None) -> DecodeState:
        """Copy ``prefix`` into ``slot`` and arm it with ``sampling`` (donates ``decode_state``)."""
        self._check_slot(slot)
        settings = self.settings(sampling or SamplingParams())
        return self._call(self._jit_insert, prefix, decode_state, np.int32(slot), settings)

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int],
                    sampling: SamplingParams | None = None) -> DecodeState:
        """Copy one prefix into several slots (the samples of a group); donates ``decode_state``.

        ``slots`` is padded to a power of two with an out-of-range index (writes dropped), so
        group sizes up to n compile about log2(n) programs.
        """
        slots = [int(s) for s in slots]
        if not slots or len(set(slots)) != len(slots):
            raise ValueError(f"bulk_insert needs distinct slots, got {slots}.")
        for s in slots:
            self._check_slot(s)
        padded = padded_indices(slots, self.num_slots)
        settings = self.settings(sampling or SamplingParams())
        return self._call(self._jit_bulk_insert, prefix, decode_state, padded, settings)

    def insert_sequences(self, params: nnx.State, decode_state: DecodeState, slots: Sequence[int],
                         sequences: Sequence[Sequence[int]],
                         samplings: Sequence[SamplingParams]) -> DecodeState:
        """Prefill ``sequences[i]`` and arm ``slots[i]`` with it and ``samplings[i]``, for all i; donates
        ``decode_state`` (``prefill.insert_sequences``: batched calls, one program per bucket)."""
        return insert_sequences(self, params, decode_state, slots, sequences, samplings)

    def release(self, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Mark ``slots`` free (done) so later steps leave them alone; donates ``decode_state``. A slot a standby
        row moved into after the last placement reported to :meth:`standby_moved` is spared: it holds another
        request by now."""
        mask = np.zeros((self.num_slots,), bool)
        for s in slots:
            self._check_slot(s)
            mask[int(s)] = True
        return self._call(self._jit_release, decode_state, mask, self.known_placements())

    def generate(self, params: nnx.State, decode_state: DecodeState,
                 rng: jax.Array) -> tuple[DecodeState, StepResult]:
        """One decode step for every slot (donates ``decode_state``); see the module docstring.

        ``rng`` is a PRNG key or its raw uint32 key data ([2] for the default implementation).
        """
        if jax.dtypes.issubdtype(getattr(rng, "dtype", np.uint32), jax.dtypes.prng_key):
            rng = jax.random.key_data(rng)  # one compiled program for typed keys and raw key data
        return self._call(self._jit_generate, params, decode_state, rng, filters=self.sampling_filters)

    def can_admit(self, prompt_length: int, max_new_tokens: int, n: int = 1) -> bool:
        """Whether the cache can take n samples of this size now (always, for the dense cache). ``reserve``: the
        same, holding the memory for the insert that follows (nothing to hold for the dense cache)."""
        return True

    reserve = can_admit

    def finished(self, slot: int) -> None:
        """Host hook: the loop handed back the sequence in ``slot`` (nothing to do for the dense cache)."""

    def generate_steps(self, params: nnx.State, decode_state: DecodeState, keys: np.ndarray,
                       routes: bool = False) -> tuple[DecodeState, MultiStepResult]:
        """K decode steps in one dispatch (donates ``decode_state``; ``sampler.multistep``): keys [K, 2]
        uint32 raw key data, step t drawing with ``keys[t]`` exactly as :meth:`generate` would. routes: the result
        carries the experts each step sent each slot's token to (``MultiStepResult.routes``)."""
        return self._call(self._jit_generate_steps, params, decode_state, keys, filters=self.sampling_filters,
                          routes=bool(routes))
