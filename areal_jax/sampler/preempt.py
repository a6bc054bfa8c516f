"""Preemption: over a paged cache admitted optimistically, running samples give their pages back when the others
need them, and resume later by recomputing their cache.

With ``PagedEngine(admission="optimistic")`` a sample is admitted when the pool holds its prompt and the next
dispatch's growth of every live sequence, not its longest possible length, so long-tailed generations share
a pool that worst-case reservations would leave mostly empty. When a dispatch would need more pages than are
free (``PagedEngine.shortfall``), the loop first fetches the dispatches in flight (finished samples return
their pages), then hands pages back until the dispatch fits: staged samples first (they have generated
nothing), then the running samples with the fewest generated tokens (the least to recompute). Each goes back to
the head of the queue with what it has generated; when pages allow, it is prefilled again (prompt + tokens so
far, under the params of that moment, as a recompute weight update does) and decodes on. Its tokens keep their
version tags, so its trajectory is what an interrupted and resumed generation would give.

:class:`Preemption` is mixed into the loop thread (``sampler.loop_thread``), which provides ``engine``,
``_running``, ``_free``, ``_standby``, ``_standby_free``, ``_queue``, ``_state``, ``_params``, ``_version``,
``_cond``, ``_stats``, ``record_routes`` and ``_drain``.
"""
from __future__ import annotations

import dataclasses

from areal_jax.sampler.requests import _Queued, _Running
from areal_jax.sampler.routes import split_routes


def resume_entry(run: _Running) -> _Queued:
    """A queue entry that resumes ``run``: one sample, its remaining budget, the tokens it generated kept."""
    sampling = dataclasses.replace(run.sampling, max_new_tokens=run.sampling.max_new_tokens - len(run.tokens))
    return _Queued(run.request, sampling, next_index=run.sample_index, resume=run)


class Preemption:
    """The loop thread's preemption (see the module docstring)."""

    def _short_of_pages(self, k: int) -> bool:
        shortfall = getattr(self.engine, "shortfall", None)
        return shortfall is not None and shortfall(k) > 0

    def _preempt(self, k: int) -> None:
        """Hand pages back until a dispatch of k steps fits the pool."""
        self._drain()  # finished samples return their pages, and no dispatch in flight can move a staged one
        while self.engine.shortfall(k) > 0 and (self._standby or len(self._running) > 1):
            if self._standby:
                row = max(self._standby)
                run = self._standby.pop(row)
                self._standby_free.append(row)
                self._state = self.engine.release_standby(self._state, [row])
            else:
                slot = min(self._running, key=lambda s: len(self._running[s].tokens))
                run = self._running.pop(slot)
                self._state = self.engine.release(self._state, [slot])
                self._free.append(slot)
            with self._cond:
                self._queue.appendleft(resume_entry(run))
                self._stats["preempted"] += 1

    def _resume(self, q: _Queued, slot: int) -> bool:
        """Put the preempted sample at the queue head back into ``slot`` (taken from the free slots, given back
        when the pool cannot take the sample yet): prefill its prompt and the tokens it generated, under the
        current params. False when the pool cannot take it yet."""
        run = q.resume
        sequence = list(run.request.prompt) + run.tokens
        if not self.engine.reserve(len(sequence), q.sampling.max_new_tokens, 1):
            self._free.append(slot)
            return False
        if run.tokens or not self.record_routes:
            self._state = self.engine.insert_sequences(self._params, self._state, [slot], [sequence], [q.sampling])
        else:  # nothing generated yet: this prefill draws its first token, so its prompt's routes are this prefill's
            prefix, run.prompt_routes = split_routes(self.engine.prefill_many(self._params, [sequence], routes=True)[0])
            self._state = self.engine.insert(prefix, self._state, slot, q.sampling)
        run.logits_version = self._version
        self._running[slot] = run
        with self._cond:
            self._queue.popleft()
        return True
