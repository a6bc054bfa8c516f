"""The decode engine over a paged KV cache (``models.paged_attention``, ``sampler.pages``).

Same API and results as :class:`Engine`; the cache is a pool of ``num_pages`` pages of ``page_size``
positions instead of [num_slots, max_len] rows. The engine keeps the page bookkeeping on the host:

- insert / insert_sequences take pages for the prompt; a group (``bulk_insert``) shares its prompt's full
  pages between its samples, each sample writing its own partial last page (copy on write);
- before each dispatch of k steps every active slot gets pages for k more positions (capped at its
  request's length), so pages are taken as sequences grow, and ``release`` returns them;
- ``can_admit`` tells the loop whether the pool still holds a request's worst case (prompt + max new
  tokens) on top of what the running sequences may still take, so growth never runs out of pages and
  the number of live sequences is limited by memory rather than by slots x max_len.

Recompute after a weight update re-prefills each sequence into its own pages; a group's shared prompt
pages are then rewritten by each sample with the same prompt keys and values (up to rounding of the batch
shape), never with a sample's generated tokens.

Standby rows (``sampler.standby``) hold pages too: the allocator's table has a row per slot and one per
standby row. A staged sample takes pages for its prompt plus 2k positions (k steps per dispatch: it may
decode for the rest of the dispatch it is placed in and all of the next before the host learns where it
went), and its reservation counts like a running slot's. Placing a row on the device copies its table row
into the slot's (no cache is copied); the host moves the pages when it learns of the move
(``standby_moved``). Until then the host's table row of that slot is stale, so an upload keeps the device's
row wherever the slot's placement count has moved past the host's (``DecodeState.placements``).

The table has no upload program of its own: every program that takes the decode state (insert, stage, release,
the k-step dispatch...) runs in a form that takes the host's table as two more arguments and applies it first,
so the paged engine dispatches as many programs as the dense one (``_state_program``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from areal_jax.models import KVCache
from areal_jax.models.config import model_config_of
from areal_jax.models.paged_attention import (
    PagedKVCache,
    init_paged_cache,
    init_rings,
    page_coordinates,
    paged_hidden,
    write_pages,
)
from areal_jax.models.transformer import ring_layers
from areal_jax.sampler import paged_choice
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.page_budget import PageBudget
from areal_jax.sampler.pages import PageAllocator
from areal_jax.sampler.prefill import last_tokens, write_rows
from areal_jax.sampler.sampling import SamplingParams
from areal_jax.sampler.slots import empty_decode_state, place_standby
from areal_jax.sampler.state import DecodeState, MultiStepResult, Prefix, SlotSettings


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCacheState:
    """The cache field of a paged DecodeState: pages (L layers of [K, N, page_size, Dh]), table [S, P] int32
    (-1 = none) and, for a model with sliding-window layers, their rows as rings (`paged_attention.init_rings`
    [S, window, K, Dh]; those layers have no pages). A paged standby's cache is one too, without pages."""

    pages: PagedKVCache | None
    table: jax.Array
    rings: KVCache | None = None


def _write_rows(cache: PagedCacheState, table: jax.Array, rows: Any, slots: jax.Array,
                lengths: jax.Array) -> PagedCacheState:
    """Write a dense prefill cache (``rows``: a KVCache of L layers [R, T, K, Dh], positions 0..T-1, lengths [R]
    or [] real ones; R = 1 is copied to every row) into the pages of table [n, P] and the ring rows ``slots`` [n]
    (out of range: dropped)."""
    pages, rings = cache.pages, cache.rings
    if rings is not None:
        rings = write_rows(rings, rows, slots, lengths)
    if pages is not None:
        n, t = table.shape[0], max(x.shape[1] for x in rows.k)  # (a Gated DeltaNet layer's window is shorter)
        full = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape[1:]), rows)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (n, t))
        page, offset = page_coordinates(table, positions, pages.page_size, pages.num_pages)
        write = lambda dst, src: write_pages(dst, page, offset, src) if dst.shape[1] else dst  # noqa: E731
        pages = PagedKVCache(k=tuple(map(write, pages.k, full.k)), v=tuple(map(write, pages.v, full.v)))
    return PagedCacheState(pages, cache.table, rings)


class PagedEngine(PageBudget, Engine):
    """:class:`Engine` over a paged KV cache.

    Args (besides Engine's):
      page_size: positions per page.
      num_pages: pages in the pool; default the dense cache's memory (num_slots x max_len positions).
      attention: "gather", "kernel" (the backend's Pallas paged-attention kernel) or "auto" (the default: the faster,
        timed on GPUs, else ``default_path``; ``decode_choice`` says what it took, ``sampler.paged_choice``).
    Sliding-window layers keep rings of their window per slot and standby row instead of pages (``ring_cache``,
    as in Engine), so a page holds only the other layers.
    """

    def __init__(self, model_graphdef_or_model: nnx.Module | nnx.GraphDef, *, num_slots: int, max_len: int,
                 page_size: int = 16, num_pages: int | None = None, attention: str | None = "auto",
                 admission: str = "reserve", **kwargs: Any) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}.")
        if admission not in ("reserve", "optimistic"):
            raise ValueError(f'admission must be "reserve" or "optimistic", got {admission!r}.')
        self.admission = admission
        self._k = 1  # steps of the last dispatch: the growth an optimistic admission leaves room for
        self.page_size = int(page_size)
        cfg = kwargs.get("config") or model_config_of(model_graphdef_or_model, required=False)
        per_sequence = -(-int(max_len) // self.page_size)
        choice = paged_choice.resolve(attention, cfg, int(num_slots), per_sequence, self.page_size, kwargs.get("mesh"))
        self.attention, self.attention_tiling = choice.path, choice.tiling
        self.pages_per_slot = per_sequence  # the page table's width
        if self.attention == "kernel":  # the TPU kernel's blocks divide the width (the GPU's pad it themselves)
            self.pages_per_slot = -(-per_sequence // 16) * 16
        self.num_pages = int(num_pages) if num_pages is not None else int(num_slots) * per_sequence
        if self.num_pages < per_sequence:
            raise ValueError(f"num_pages={self.num_pages} cannot hold one sequence of max_len={max_len} "
                             f"({per_sequence} pages of {self.page_size}); raise num_pages or lower max_len.")
        self._rows = int(num_slots) + max(0, int(kwargs.get("standby_rows") or 0))  # allocator rows: slots, standby
        self.rings = ring_layers(cfg, int(max_len)) if cfg is not None and kwargs.get("ring_cache", True) else ()
        if cfg is not None and cfg.recurrent:  # stateful layers keep a state per row beside the pages (in its entry)
            self.rings = tuple(sorted({*self.rings, *(cfg.state_entry(i) for i in range(cfg.num_layers)
                                                      if cfg.layer_is_linear(i) or cfg.layer_is_hybrid(i))}))
        self.allocator = PageAllocator(self.num_pages, self.page_size, self._rows, self.pages_per_slot)
        self._limit: dict[int, int] = {}  # active row -> most positions its request can reach
        self._upper: dict[int, int] = {}  # active row -> upper bound of positions written so far
        self._staged: dict[int, int] = {}  # allocator row of a staged sample -> its prompt length
        self.peak_active = 0
        self._dirty = False  # the host table changed since the last upload
        self._promised = 0  # pages reserved by admissions not inserted yet
        self._table_dev: tuple[np.ndarray, np.ndarray] | None = None  # the last upload: (table, placements)
        # The programs that take the table (``_state_program``), by id; held here, so no other object takes an id.
        self._table_programs: dict[int, Any] = {}
        kwargs.setdefault("decode_attention", "xla")  # the dense cache's choice; the pages have their own kernel
        super().__init__(model_graphdef_or_model, num_slots=num_slots, max_len=max_len, **kwargs)
        self.decode_choice = choice  # the pages' choice, not the dense cache's

    def _state_program(self, fn: Any, at: int, static: tuple[str, ...] = (), result: bool = False) -> Any:
        """The base engine's state program of `fn`, taking the host's page table too (keyword arguments ``table``
        and ``placements``) and applying it (``_set_table_fn``) first, inside the same program: the table reaches
        the device without a dispatch of its own (``_program_kwargs`` passes it)."""
        def run(*args: Any, table: Any, placements: Any, **kw: Any) -> Any:
            args = list(args)
            args[at] = self._set_table_fn(args[at], table, placements)
            return fn(*args, **kw)

        program = super()._state_program(run, at, static, result)
        self._table_programs[id(program)] = program
        return program

    def _program_kwargs(self, fn: Any) -> dict[str, Any]:
        """A state program's page table: the host's, when it changed since the last call; else the last one again,
        which changes nothing on the device."""
        if id(fn) not in self._table_programs:
            return {}
        if self._dirty or self._table_dev is None:
            # Host copies (the allocator changes its table in place while a transfer may still read it), passed as
            # they are: the program's own argument transfer costs less host time than a device_put beforehand.
            self._dirty = False
            self._table_dev = (self.allocator.table.copy(), self.known_placements())
        table, placements = self._table_dev
        return {"table": table, "placements": placements}

    # ----------------------------------------------------------------------------- pure functions
    def _cache_sharding(self, cache: PagedCacheState) -> PagedCacheState:
        """Pages [K, N, page_size, Dh] and ring rows [rows, window, K, Dh] split their kv heads as the dense cache does
        (`_cache_spec`; the kernel then runs per head shard); the page table is replicated."""
        rows, whole = self._cache_spec(), NamedSharding(self.mesh, PartitionSpec())
        pages = NamedSharding(self.mesh, PartitionSpec(rows[2] if len(rows) > 2 else None, None, None, None))
        tree = lambda x, s: None if x is None else jax.tree.map(lambda _: s, x)  # noqa: E731
        return PagedCacheState(tree(cache.pages, pages), whole, tree(cache.rings, NamedSharding(self.mesh, rows)))

    def _init_fn(self) -> DecodeState:
        cfg, n, rings = self.config, self.num_slots, self.rings

        def ring_rows(rows: int) -> KVCache | None:
            return init_rings(cfg, rows, self.max_len, rings) if rings else None

        cache = PagedCacheState(init_paged_cache(cfg, self.num_pages, self.page_size, rings=rings),
                                jnp.full((n, self.pages_per_slot), -1, jnp.int32), ring_rows(n))
        standby = None
        if self.standby_rows:  # a standby row's cache is its page-table row (its pages live in the pool) and rings
            table = jnp.full((self.standby_rows, self.pages_per_slot), -1, jnp.int32)
            standby = empty_decode_state(PagedCacheState(None, table, ring_rows(self.standby_rows)),
                                         cfg.vocab_size, self.standby_rows, self.max_stop_tokens)
        return empty_decode_state(cache, cfg.vocab_size, n, self.max_stop_tokens, standby)

    def _set_table_fn(self, state: DecodeState, table: jax.Array, placements: jax.Array) -> DecodeState:
        """The host's table [S + R, P]: slot rows where the device has no placement the host has not seen,
        then the standby rows."""
        s = self.num_slots
        rows = jnp.where((state.placements == placements)[:, None], table[:s], state.cache.table)
        state = dataclasses.replace(state, cache=dataclasses.replace(state.cache, table=rows))
        if state.standby is None:
            return state
        sb = state.standby
        return dataclasses.replace(state, standby=dataclasses.replace(sb, cache=dataclasses.replace(sb.cache,
                                                                                                   table=table[s:])))

    def _place_fn(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
        def move_rows(cache: PagedCacheState, standby: PagedCacheState, targets: jax.Array,
                      lengths: jax.Array) -> PagedCacheState:
            rings = None if cache.rings is None else jax.tree.map(  # a ring row is copied; pages are not
                lambda dst, src: dst.at[targets].set(src, mode="drop"), cache.rings, standby.rings)
            return PagedCacheState(cache.pages, cache.table.at[targets].set(standby.table, mode="drop"), rings)

        return place_standby(state, move_rows)

    def _stage_fn(self, prefix: Prefix, state: DecodeState, rows: jax.Array, settings: SlotSettings) -> DecodeState:
        sb = state.standby
        table = sb.cache.table.at[rows].get(mode="fill", fill_value=-1)  # the rows' pages (in the pool), rings
        written = _write_rows(PagedCacheState(state.cache.pages, table, sb.cache.rings), table, prefix.cache, rows,
                              prefix.true_length)
        sb = self._set_slot_fields(dataclasses.replace(sb, cache=dataclasses.replace(sb.cache, rings=written.rings)),
                                   prefix.logits, prefix.true_length, prefix.last_token, rows, settings, mode="drop")
        return dataclasses.replace(state, cache=dataclasses.replace(state.cache, pages=written.pages), standby=sb)

    def _rows_of(self, state: DecodeState, slots: jax.Array) -> jax.Array:
        return state.cache.table.at[slots].get(mode="fill", fill_value=-1)  # padding slots: no pages

    def _insert_fn(self, prefix: Prefix, state: DecodeState, slot: jax.Array, settings: SlotSettings) -> DecodeState:
        cache = _write_rows(state.cache, self._rows_of(state, slot[None]), prefix.cache, slot[None],
                            prefix.true_length)
        return self._set_slot_fields(dataclasses.replace(state, cache=cache), prefix.logits, prefix.true_length,
                                     prefix.last_token, slot, settings, mode=None)

    def _bulk_insert_fn(self, prefix: Prefix, state: DecodeState, slots: jax.Array, settings: SlotSettings) -> DecodeState:
        cache = _write_rows(state.cache, self._rows_of(state, slots), prefix.cache, slots, prefix.true_length)
        return self._set_slot_fields(dataclasses.replace(state, cache=cache), prefix.logits, prefix.true_length,
                                     prefix.last_token, slots, settings, mode="drop")

    def _prefill_insert_fn(self, params: nnx.State, state: DecodeState, tokens: jax.Array, lengths: jax.Array,
                           slots: jax.Array, settings: SlotSettings) -> DecodeState:
        rows, logits = self._prefill_rows(params, tokens, lengths)
        state = dataclasses.replace(state, cache=_write_rows(state.cache, self._rows_of(state, slots), rows, slots,
                                                             lengths))
        return self._set_slot_fields(state, logits, lengths, last_tokens(tokens, lengths), slots, settings,
                                     mode="drop")

    def _decode_forward(self, model: nnx.Module, tokens: jax.Array, positions: jax.Array, cache: PagedCacheState,
                        routes: bool = False) -> tuple:
        h, pages, *rest = paged_hidden(model, tokens, positions, cache.pages, cache.table, path=self.attention,
                                       tiling=self.attention_tiling,
                                       interpret=jax.default_backend() not in ("gpu", "tpu"),  # interpreted elsewhere
                                       rings=cache.rings, mesh=self.mesh, record_routes=routes)
        rings = rest[:1] if cache.rings is not None else ()
        return model.unembed(h), PagedCacheState(pages, cache.table, *rings), *rest[len(rings):]

    # ----------------------------------------------------------------------------- host-side pages
    def _upload(self, state: DecodeState) -> DecodeState:
        """Mark the host's table for upload: the next program that takes the state applies it first (``_call``)."""
        self._dirty = True
        return state

    def finished(self, slot: int) -> None:
        """The slot's sequence was handed back: its pages return to the pool (the device table row is
        cleared before the next dispatch; a dispatch already in flight only writes the finished row's own
        junk, before any new owner writes the page, and nothing reads it)."""
        self._free_slot(int(slot))

    def init_decode_state(self) -> DecodeState:
        """A fresh state with an empty pool: the host bookkeeping starts over too."""
        self.allocator = PageAllocator(self.num_pages, self.page_size, self._rows, self.pages_per_slot)
        self._limit.clear()
        self._upper.clear()
        self._staged.clear()
        self._promised, self._dirty, self._table_dev = 0, False, None  # the fresh table goes up with the next program
        return super().init_decode_state()

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int,
               sampling: SamplingParams | None = None) -> DecodeState:
        self._check_slot(slot)
        self._free_slot(int(slot))
        length, max_new = int(prefix.true_length), (sampling or SamplingParams()).max_new_tokens
        self._redeem(length, max_new, 1)
        self.allocator.ensure(int(slot), length)
        self._activate(int(slot), length, sampling)
        return super().insert(prefix, self._upload(decode_state), slot, sampling)

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int],
                    sampling: SamplingParams | None = None) -> DecodeState:
        slots = [int(s) for s in slots]
        length = int(prefix.true_length)
        for s in slots:
            self._check_slot(s)
            self._free_slot(s)
        self._redeem(length, (sampling or SamplingParams()).max_new_tokens, len(slots))
        self.allocator.ensure(slots[0], length)
        self.allocator.share_prefix(slots[0], slots, length)  # each sample writes its partial page itself
        for s in slots:
            self._activate(s, length, sampling)
        return super().bulk_insert(prefix, self._upload(decode_state), slots, sampling)

    def insert_sequences(self, params: nnx.State, decode_state: DecodeState, slots: Sequence[int],
                         sequences: Sequence[Sequence[int]],
                         samplings: Sequence[SamplingParams]) -> DecodeState:
        for s, seq, sp in zip(slots, sequences, samplings):
            self._check_slot(int(s))
            if int(s) not in self._limit:  # a new sequence, not the recompute of a running one
                self._free_slot(int(s))
                self._redeem(len(seq), sp.max_new_tokens, 1)
            self.allocator.ensure(int(s), len(seq))
            self._activate(int(s), len(seq), sp)
        return super().insert_sequences(params, self._upload(decode_state), slots, sequences, samplings)

    def release(self, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        for s in slots:
            self._check_slot(int(s))
            self._free_slot(int(s))
        return super().release(self._upload(decode_state), slots)

    def can_stage(self, prefix: Prefix) -> bool:
        """Whether standby rows exist (a row's prompt lives in pages, so any prompt fits one)."""
        return bool(self.standby_rows)

    def stage(self, prefix: Prefix, decode_state: DecodeState, rows: Sequence[int],
              sampling: SamplingParams | None = None) -> DecodeState:
        """``StandbyRows.stage`` into pages: the rows share the prompt's full pages (each writes its partial last
        page itself). Staging rows that already hold a sample (the recompute after a weight update) gives them
        fresh pages without taking a new reservation."""
        self._rows_mask(rows)
        sampling = sampling or SamplingParams()
        length = int(prefix.true_length)
        alloc = [self.num_slots + int(r) for r in rows]
        if not any(a in self._limit for a in alloc):
            self._redeem(length, sampling.max_new_tokens, len(alloc))
        for a in alloc:
            self._free_slot(a)
        self.allocator.ensure(alloc[0], length)
        self.allocator.share_prefix(alloc[0], alloc, length)
        for a in alloc:
            self._staged[a] = length
            self._activate(a, length, sampling)
        self._dirty = True
        return super().stage(prefix, self._upload(decode_state), rows, sampling)

    def release_standby(self, decode_state: DecodeState, rows: Sequence[int]) -> DecodeState:
        for r in self._rows_mask(rows).nonzero()[0]:
            self._free_slot(self.num_slots + int(r))
        return super().release_standby(self._upload(decode_state), rows)

    def standby_moved(self, moves: Sequence[tuple[int, int]]) -> None:
        """The pages (and page budget) of each moved standby row become its slot's; the slot's previous occupant
        finished inside that dispatch, so its pages return to the pool."""
        super().standby_moved(moves)
        for row, slot in moves:
            row, slot = self.num_slots + int(row), int(slot)
            self._free_slot(slot)
            self.allocator.move(row, slot)
            self._limit[slot], self._upper[slot] = self._limit.pop(row), self._upper.pop(row)
            self._staged.pop(row)
            self._dirty = True

    def generate_steps(self, params: nnx.State, decode_state: DecodeState, keys: np.ndarray,
                       routes: bool = False) -> tuple[DecodeState, MultiStepResult]:
        """Take pages for k more positions of every active slot (and staged sample), then run the dispatch."""
        self._grow(int(np.shape(keys)[0]))
        return super().generate_steps(params, decode_state, keys, routes)

    def generate(self, params: nnx.State, decode_state: DecodeState, rng: jax.Array):
        self._grow(1)
        return super().generate(params, decode_state, rng)
