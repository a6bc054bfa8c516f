"""Standby rows: prefilled requests that wait on the device for a decode slot.

Between dispatches the loop can only fill slots it knows are free, and with fetch-behind it learns that a
slot finished one dispatch late: a finished slot idles for the rest of its dispatch and all of the next
(about 1.5 k steps with k steps per dispatch). With standby rows the loop *stages* queued requests on the
device instead (prefilled, armed with their settings, in ``DecodeState.standby``), and the multi-step
decode moves each one into a slot the step after that slot finishes (``slots.place_standby``). The
dispatch result says which row went where and from which step (``MultiStepResult.placed_slot`` /
``placed_step``), so the host hands every token to the right request.

The dense-cache :class:`~areal_jax.sampler.engine.Engine` takes ``standby_rows`` (R) and ``standby_len``
(the longest prompt bucket a row holds); the rows' cache costs R x standby_len positions. The paged engine
takes ``standby_rows`` too: a staged prompt lives in pool pages, and placing it moves only its page-table row
(``sampler.paged_engine``).

Each placement counts in ``DecodeState.placements``; the host reports the moves it learns of
(:meth:`StandbyRows.standby_moved`), and a release passes the count it knows, so the device spares a slot a
staged request has taken since the host last looked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np

from areal_jax.models import init_cache
from areal_jax.sampler.config import STANDBY_LEN
from areal_jax.sampler.prefill import write_rows
from areal_jax.sampler.sampling import SamplingParams
from areal_jax.sampler.slots import empty_decode_state, free_slots, place_standby
from areal_jax.sampler.state import DecodeState, Prefix, SlotSettings


def padded_indices(indices: Sequence[int], fill: int, cap: int | None = None) -> np.ndarray:
    """``indices`` padded with ``fill`` (an out-of-range index, whose writes are dropped) to a power of two, at most
    ``cap``: a scatter visits every padded index, so the write costs about the indices given, for about log2(n)
    programs."""
    size = 1 << math.ceil(math.log2(len(indices)))
    padded = np.full((size if cap is None else min(cap, size),), fill, np.int32)
    padded[: len(indices)] = indices
    return padded


def standby_size(rows: int, length: int | None, max_len: int) -> tuple[int, int]:
    """Checked (rows, length): rows >= 0; length in [1, max_len], default min(max_len, 512)."""
    rows = int(rows)
    length = min(int(max_len), STANDBY_LEN) if length is None else int(length)
    if rows < 0:
        raise ValueError(f"standby_rows must be >= 0 (0 turns the standby off), got {rows}.")
    if rows and not 1 <= length <= max_len:
        raise ValueError(f"standby_len must lie in [1, max_len={max_len}], got {length}.")
    return rows, length


def write_moved_rows(cache: Any, rows: Any, targets: jax.Array, lengths: jax.Array) -> Any:
    """Write rows[j] ([standby_len, ...] per layer, lengths[j] real positions) into positions 0.. of slot
    targets[j], for the j whose target is a slot (< S; the others are dropped): one in-place scatter per layer
    buffer, with no branch on how many rows move (a ring layer takes each row's last positions,
    ``prefill.write_rows``)."""
    return write_rows(cache, rows, targets, lengths)


class StandbyRows:
    """The Engine's standby: pure functions, jitted calls and the host API (mixed into the Engine, which
    provides config, max_len, num_slots, max_stop_tokens, _bulk_insert_fn and _call; it builds `_jit_stage` and
    `_jit_release_standby` with its other state programs, `Engine._build_state_programs`)."""

    standby_rows: int = 0
    standby_len: int = 0
    _placements: np.ndarray  # [S] the placements the host knows of (DecodeState.placements)

    def _reset_placements(self) -> None:
        self._placements = np.zeros((self.num_slots,), np.int32)

    def known_placements(self) -> np.ndarray:
        """[S] int32 placements into each slot the host has learned of (``standby_moved``)."""
        return self._placements.copy()

    def standby_moved(self, moves: Sequence[tuple[int, int]]) -> None:
        """Host hook: a fetched dispatch moved standby row ``row`` into slot ``slot``, for each (row, slot) of
        ``moves`` in the order it happened (the paged engine moves the row's pages with it)."""
        for _, slot in moves:
            self._placements[int(slot)] += 1

    def _standby_state(self) -> DecodeState | None:
        if not self.standby_rows:
            return None
        cache = init_cache(self.config, self.standby_rows, self.standby_len)
        return empty_decode_state(cache, self.config.vocab_size, self.standby_rows, self.max_stop_tokens)

    def _place_fn(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
        return place_standby(state, write_moved_rows)

    def _stage_fn(self, prefix: Prefix, state: DecodeState, rows: jax.Array, settings: SlotSettings) -> DecodeState:
        return dataclasses.replace(state, standby=self._bulk_insert_fn(prefix, state.standby, rows, settings))

    @staticmethod
    def _release_standby_fn(state: DecodeState, free: jax.Array) -> DecodeState:
        return dataclasses.replace(state, standby=free_slots(state.standby, free))

    def can_stage(self, prefix: Prefix) -> bool:
        """Whether a standby row holds this prefix (its prompt bucket fits standby_len)."""
        return bool(self.standby_rows) and jax.tree.leaves(prefix.cache)[0].shape[1] <= self.standby_len

    def _rows_mask(self, rows: Sequence[int]) -> np.ndarray:
        rows = [int(r) for r in rows]
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < self.standby_rows for r in rows):
            raise ValueError(f"standby rows must be distinct indices in [0, {self.standby_rows}), got {rows}.")
        mask = np.zeros((self.standby_rows,), bool)
        mask[rows] = True
        return mask

    def stage(self, prefix: Prefix, decode_state: DecodeState, rows: Sequence[int],
              sampling: SamplingParams | None = None) -> DecodeState:
        """Copy one prefix into standby ``rows`` (the samples of a group) armed with ``sampling``; the next
        multi-step dispatch moves them into slots as slots free up. Donates ``decode_state``."""
        self._rows_mask(rows)
        if not self.can_stage(prefix):
            raise ValueError(f"this prefix does not fit a standby row (standby_rows={self.standby_rows}, "
                             f"standby_len={self.standby_len}); insert it into a free slot instead.")
        padded = padded_indices(rows, self.standby_rows, cap=self.standby_rows)  # copies the rows staged, not all R
        return self._call(self._jit_stage, prefix, decode_state, padded, self.settings(sampling or SamplingParams()))

    def release_standby(self, decode_state: DecodeState, rows: Sequence[int]) -> DecodeState:
        """Empty standby ``rows`` (their requests will not be placed); donates ``decode_state``."""
        return self._call(self._jit_release_standby, decode_state, self._rows_mask(rows))

    def standby_sharding(self, shapes: DecodeState, cache_sharding: Any, replicated: Any) -> DecodeState | None:
        """Shardings of the standby part of a state of these shapes: the cache like the slots' cache
        (`cache_sharding(cache shapes)`)."""
        if shapes.standby is None:
            return None
        sb = shapes.standby
        return dataclasses.replace(jax.tree.map(lambda _: replicated, sb), cache=cache_sharding(sb.cache))
