"""What a SamplerLoop's own thread runs: between dispatches it applies a pending weight update, handles
aborts and admits queued requests; it issues k-step dispatches and fetches their results.

:class:`LoopThread` is mixed into :class:`~areal_jax.sampler.loop.SamplerLoop`, whose ``__init__`` creates
the state used here: ``engine``, ``on_update``, ``decode_steps``, ``fetch_behind``, ``timeline``; the
lock-guarded ``_cond``, ``_queue`` (queued requests), ``_out`` (finished completions), ``_pending``,
``_pending_update``, ``_aborts``, ``_paused`` / ``_idle``, ``_stop_mode``, ``_error``, ``_stats`` and
``_max_update_wait``; and, touched by this thread only, ``_running`` (slot -> sample), ``_free`` (free
slots), ``_standby`` (standby row -> staged sample) and ``_standby_free`` (rows free to stage into; see
``sampler.standby``), ``_inflight`` (dispatches not yet fetched), ``_state`` (the DecodeState), ``_params`` /
``_version`` (written under ``_cond``) and ``_keys``.

A slot the host believes free may still take a staged sample inside a dispatch in flight, so the host inserts
directly into free slots only while no dispatch in flight carries staged rows (``_direct``), and otherwise stages
the queue head, for the device to place. (Inserting above the lowest free slots that the rows in flight could take,
which the device fills lowest first, gave exact, correctly distributed tokens; at the LoRA default's old lr 1e-3, a
recipe at the edge of stability, it moved runs onto schedules that collapsed late, and at lr 5e-4 it did no harm,
but its occupancy gain was small, so it stays withdrawn: docs/measurements.md.) A prompt too long for a standby row
(by default every prompt fits one: ``RolloutConfig.for_prompts``) waits for a dispatch without staged rows. For the
same reason a release names the placements the host knows of (the device spares a slot a staged sample has taken
since), and an abort of staged samples first fetches the dispatches in flight, so a staged row (over a paged cache,
its pages too) is freed only once no dispatch can place it.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any, ContextManager, Hashable

import numpy as np

from areal_jax.models.flat_params import FlatParams
from areal_jax.sampler.dispatch import Dispatch, record_dispatch
from areal_jax.sampler.page_budget import most_that_fit
from areal_jax.sampler.preempt import Preemption
from areal_jax.sampler.requests import Completion, FinishReason, _Queued, _Running, make_completion
from areal_jax.sampler.routes import sample_routes, split_routes


class LoopThread(Preemption):
    """The loop thread's side of :class:`~areal_jax.sampler.loop.SamplerLoop` (see the module docstring)."""

    def _emit_locked(self, completion: Completion) -> None:
        self._out.append(completion)
        self._cond.notify_all()
        if self.on_emit is not None:  # e.g. sampler.replicas: a completion is ready on this replica
            self.on_emit()

    def _span(self, name: str, **args: Any) -> ContextManager[None]:
        """A timeline span on the loop's lane (``lane``, default "sampler") when a timeline is attached."""
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(name, lane=self.lane, **args)

    def _run(self) -> None:
        try:
            while self._wait_for_work():
                if self._inflight and (self._paused or not (self._running or self._standby)):
                    self._drain()  # a paused or empty loop owes the caller every result
                    continue
                self._between_steps()
                with self._span("decode_step", running=len(self._running), steps=self.decode_steps):
                    if self._running or self._standby:
                        self._dispatch()
                    while len(self._inflight) > (1 if self.fetch_behind else 0):
                        self._process(self._inflight.popleft())
            self._interrupt_all()
        except BaseException as exc:  # surfaced to the caller by _raise_if_failed
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False when the thread should exit."""
        with self._cond:
            while True:
                if self._stop_mode == "now":
                    return False
                if self._paused and self._inflight:
                    return True  # fetch the dispatch in flight before going idle
                if self._paused:
                    self._idle = True
                    self._cond.notify_all()
                    self._cond.wait()
                    continue
                if (self._running or self._standby or self._queue or self._pending_update or self._aborts
                        or self._inflight):
                    return True
                if self._stop_mode == "graceful":
                    return False
                self._cond.wait()

    def _between_steps(self) -> None:
        with self._cond:
            update, self._pending_update = self._pending_update, None
            aborts, self._aborts = self._aborts, set()
        if update is not None:
            if self.on_update == "recompute":
                self._drain()  # re-prefill needs every token generated so far
            with self._span("weight_update", version=update[1], recompute=len(self._running)):
                self._apply_update(update[0], update[1])
            wait = time.monotonic() - update[2]
            with self._cond:
                self._stats["update_wait_s"] += wait
                self._max_update_wait = max(self._max_update_wait, wait)
        if aborts:
            self._apply_aborts(aborts)
        if self._queue and (self._free or self._standby_free):
            with self._span("admit_prefill"):
                self._admit()

    def _finish(self, slot: int, reason: FinishReason) -> None:
        self._finish_run(slot, self._running[slot], reason)

    def _finish_run(self, slot: int, run: _Running, reason: FinishReason) -> None:
        """Hand ``run`` back; its slot becomes free unless another run has taken it since."""
        run.active = False
        if self._running.get(slot) is run:
            del self._running[slot]
            self.engine.finished(slot)
            self._free.append(slot)
        completion = make_completion(run.request, run.sample_index, run.tokens, run.logprobs, run.versions, reason)
        if self.record_routes and reason in ("stop", "length"):  # the experts of its prefill and decode steps
            completion.routes = sample_routes(run.prompt_routes, len(completion.prompt), run.routes)
        with self._cond:
            self._pending -= 1
            self._emit_locked(completion)

    def _release(self, slots: list[int]) -> None:
        if slots:
            self._state = self.engine.release(self._state, slots)

    def _swap_params(self, params: FlatParams, version: int) -> None:
        placed = self.engine.place_params(params)
        with self._cond:  # params and version change together (see versioned_params)
            self._params, self._version = placed, version

    def _apply_update(self, params: FlatParams, version: int) -> None:
        self._swap_params(params, version)
        with self._cond:
            self._stats["updates"] += 1
        if self.on_update != "recompute":
            return
        if self._standby:  # staged samples wait with a prefix of the old params: prefill them again
            groups: dict[tuple, list[int]] = {}  # (request, sampling) -> its staged rows: one stage call each
            for row, run in self._standby.items():
                groups.setdefault((id(run.request), run.sampling), []).append(row)
                run.logits_version = version
            prompts = [list(self._standby[rows[0]].request.prompt) for rows in groups.values()]
            for (_, sampling), rows, prefix in zip(groups, groups.values(), self.engine.prefill_many(
                    self._params, prompts, routes=self.record_routes)):
                prefix, routes = split_routes(prefix)
                for row in rows:  # their first tokens will be drawn from the new prefill's logits
                    self._standby[row].prompt_routes = routes
                self._state = self.engine.stage(prefix, self._state, rows, sampling)
        if not self._running:
            return
        slots = list(self._running)
        runs = [self._running[s] for s in slots]
        self._state = self.engine.insert_sequences(
            self._params, self._state, slots,
            [list(run.request.prompt) + run.tokens for run in runs],
            [dataclasses.replace(run.sampling, max_new_tokens=run.sampling.max_new_tokens - len(run.tokens))
             for run in runs])
        for run in runs:
            run.logits_version = version
        with self._cond:
            self._stats["recomputes"] += len(runs)

    def _apply_aborts(self, ids: set[Hashable]) -> None:
        with self._cond:
            kept: collections.deque[_Queued] = collections.deque()
            for q in self._queue:
                if q.request.id in ids:
                    for completion in q.interrupted():
                        self._pending -= 1
                        self._emit_locked(completion)
                else:
                    kept.append(q)
            self._queue = kept
        if self._inflight and any(run.request.id in ids for run in self._standby.values()):
            # A dispatch in flight may move these staged samples into slots: learn where first, so a staged row
            # (and, over pages, its pages) is freed only once no dispatch can place it.
            self._drain()
        slots = [s for s, run in self._running.items() if run.request.id in ids]
        for s in slots:
            self._finish(s, "interrupted")
        self._release(slots)
        rows = [row for row, run in self._standby.items() if run.request.id in ids]
        for row in rows:
            self._unstage(row, "interrupted")
        if rows:
            self._state = self.engine.release_standby(self._state, rows)

    def _unstage(self, row: int, reason: FinishReason) -> None:
        """Hand back the sample staged in standby ``row`` (the row becomes free to stage into)."""
        run = self._standby.pop(row)
        run.active = False
        self._standby_free.append(row)
        with self._cond:
            self._pending -= 1
            self._emit_locked(make_completion(run.request, run.sample_index, reason=reason))

    def _admit(self) -> None:
        """Fill free slots from the queue, then standby rows. Each queued request's prompt is prefilled once
        (several requests' prompts per call, see :meth:`_prefill_ahead`) and its prefix copied into the
        slots (or standby rows) of its samples."""
        while True:
            direct = self._direct()
            if not (direct or self._standby_free):
                break
            with self._cond:
                if not self._queue or self._stop_mode == "now":
                    break
                q = self._queue[0]
            if q.resume is not None:  # a preempted sample: back into a free slot, its cache recomputed
                if not (direct and self._resume(q, self._take_free(direct[:1])[0])):
                    break
                continue
            if not direct:
                if not self._stage(q):
                    break
                continue
            k = self._admissible(q, len(direct))
            if k == 0:
                break
            if not self._prefix_ready(q):
                self._prefill_ahead()
            slots = self._take_free(direct[:k])
            if k == 1:
                self._state = self.engine.insert(q.prefix, self._state, slots[0], q.sampling)
            else:
                self._state = self.engine.bulk_insert(q.prefix, self._state, slots, q.sampling)
            for i, slot in enumerate(slots):
                self._running[slot] = _Running(q.request, q.next_index + i, q.sampling, q.prefix_version,
                                               prompt_routes=q.routes)
            self._advance(q, k)

    def _direct(self) -> list[int]:
        """The free slots to insert into now, highest first: every free slot when no dispatch in flight carries
        staged rows, else none (such a dispatch may move a staged sample into any slot the host believes free)."""
        return [] if any(d.standby for d in self._inflight) else self._free[::-1]

    def _take_free(self, slots: list[int]) -> list[int]:
        for slot in slots:
            self._free.remove(slot)
        return slots

    def _stage(self, q: _Queued) -> bool:
        """Stage samples of the queue head in free standby rows; False when its prompt does not fit one, or the
        cache's memory (a paged cache) holds none of them now."""
        if not self._prefix_ready(q):
            self._prefill_ahead()
        if not self.engine.can_stage(q.prefix):
            return False
        k = self._admissible(q, len(self._standby_free))
        if k == 0:
            return False
        rows = [self._standby_free.pop() for _ in range(k)]
        self._state = self.engine.stage(q.prefix, self._state, rows, q.sampling)
        for i, row in enumerate(rows):
            self._standby[row] = _Running(q.request, q.next_index + i, q.sampling, q.prefix_version,
                                          prompt_routes=q.routes)
        self._advance(q, len(rows))
        return True

    def _prefix_ready(self, q: _Queued) -> bool:
        """Whether the queued request's prefix can be inserted as it is: prefilled at the current version, or at any
        version with ``on_update="continue"``, where a running sample's cache also stays as the old params wrote
        it (its first token is then tagged with the prefix's version)."""
        return q.prefix is not None and (q.prefix_version == self._version or self.on_update == "continue")

    def _prefill_ahead(self) -> None:
        """Prefill, in one batched call, the prompts of the first queued requests that have no prefix at
        the current version: up to ``engine.prefill_batch`` distinct prompts, requests with the same prompt
        (an evaluation's greedy and sampled requests of one problem) sharing one prefix. Prefilling past
        the free slots keeps the calls full; a weight update before admission only costs a re-prefill (none
        with ``on_update="continue"``, see :meth:`_prefix_ready`)."""
        limit = self.engine.prefill_batch
        rows: dict[tuple, int] = {}
        take: list[tuple[_Queued, int]] = []
        with self._cond:
            for q in self._queue:
                if q.resume is not None or self._prefix_ready(q):
                    continue
                key = tuple(int(t) for t in q.request.prompt)
                if key not in rows:
                    if len(rows) == limit:
                        break
                    rows[key] = len(rows)
                take.append((q, rows[key]))
        prefixes = [split_routes(p) for p in self.engine.prefill_many(self._params, [list(key) for key in rows],
                                                                       routes=self.record_routes)]
        for q, row in take:
            (q.prefix, q.routes), q.prefix_version = prefixes[row], self._version

    def _admissible(self, q: _Queued, places: int) -> int:
        """Samples of the queue head that ``places`` free slots (or standby rows) and the cache's memory (a paged
        cache) take now. The memory is held for them until they are inserted; an empty pool always holds one
        sample."""
        length, max_new = len(q.request.prompt), q.sampling.max_new_tokens
        k = min(places, q.remaining)
        k = most_that_fit(lambda n: self.engine.can_admit(length, max_new, n), k)
        while k and not self.engine.reserve(length, max_new, k):
            k -= 1
        return k

    def _advance(self, q: _Queued, k: int) -> None:
        """Mark k more samples of the queue head as admitted; pop it once all are."""
        with self._cond:
            q.next_index += k
            if q.next_index == q.request.n:
                self._queue.popleft()
                q.prefix = q.routes = None

    def _dispatch(self) -> None:
        """Issue k decode steps for the running slots (asynchronously; results fetched in _process)."""
        k = self.decode_steps
        if self._short_of_pages(k):
            self._preempt(k)
            if not (self._running or self._standby):
                return
        self._state, result = self.engine.generate_steps(self._params, self._state, self._keys.take(k),
                                                         routes=self.record_routes)
        self._inflight.append(Dispatch(result, dict(self._running), self._version, dict(self._standby)))

    def _process(self, d: Dispatch) -> None:
        """Fetch one dispatch's results (blocks until it ran), hand tokens to its runs, finish slots."""
        r = d.result.to_host()
        rec = record_dispatch(r, d.runs, d.version, d.standby)
        with self._cond:
            self._stats["dispatches"] += 1
            self._stats["steps"] += int(r.steps)
            self._stats["busy_slot_steps"] += int(np.asarray(r.valid).sum())
            self._stats["generated_tokens"] += rec.appended
            self._stats["placed"] += len(rec.placed)
        self.engine.standby_moved(list(rec.placed.items()))
        for row in rec.placed:  # rows the device emptied (unless the host staged or freed them since)
            if self._standby.get(row) is d.standby[row]:
                del self._standby[row]
                self._standby_free.append(row)
        for slot, run in rec.occupants.items():  # the host learns who holds these slots now
            self._running[slot] = run
            if slot in self._free:
                self._free.remove(slot)
            for later in self._inflight:  # issued before this was known
                later.runs[slot] = run
        for slot, run, reason in rec.finished:
            self._finish_run(slot, run, reason)
        dead = [slot for slot, run in rec.occupants.items() if not run.active and self._running.get(slot) is run]
        for slot in dead:  # placed after its request was aborted: free the slot
            del self._running[slot]
            self._free.append(slot)
        self._release(dead)

    def _drain(self) -> None:
        while self._inflight:
            self._process(self._inflight.popleft())

    def _interrupt_all(self) -> None:
        """On a hard stop, hand back everything still queued or running as "interrupted" (and take a weight
        update still pending, so a stopped loop holds the last params it was given)."""
        with self._cond:
            update, self._pending_update = self._pending_update, None
        if update is not None:
            self._swap_params(update[0], update[1])
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
            for q in queued:
                for completion in q.interrupted():
                    self._pending -= 1
                    self._emit_locked(completion)
        for slot in list(self._running):
            self._finish(slot, "interrupted")
        for row in list(self._standby):
            self._unstage(row, "interrupted")
