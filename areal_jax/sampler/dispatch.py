"""Host-side bookkeeping of multi-step dispatches: which run owned each slot, and what it generated.

The loop issues dispatch i+1 before it fetches the results of dispatch i, so by the time results
arrive a slot may already hold another request, or its run may have been aborted. Each dispatch
therefore carries a snapshot of the slot -> run map and the params version it decoded with, and its
tokens go only to runs that are still active.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from areal_jax.sampler.requests import FinishReason, _Running
from areal_jax.sampler.state import MultiStepResult


class KeyStream:
    """Raw PRNG key data for decode steps: step n of a run always draws with key n, however the steps
    are grouped into dispatches (keys are split on the host in chunks, one transfer per chunk)."""

    def __init__(self, seed: int, chunk_size: int = 4096) -> None:
        self._base, self._chunk_size = jax.random.key(seed), int(chunk_size)
        self._chunk, self._keys, self.issued = -1, np.zeros((0, 2), np.uint32), 0

    def take(self, k: int) -> np.ndarray:
        """[k, 2] uint32 key data of the next k steps."""
        out = np.empty((k, 2), np.uint32)
        for i in range(k):
            chunk, index = divmod(self.issued + i, self._chunk_size)
            if chunk != self._chunk:
                keys = jax.random.split(jax.random.fold_in(self._base, chunk), self._chunk_size)
                self._keys, self._chunk = np.asarray(jax.random.key_data(keys)), chunk
            out[i] = self._keys[index]
        self.issued += k
        return out


@dataclasses.dataclass
class Dispatch:
    """One multi-step dispatch in flight.

    Attributes:
      result: the device-side MultiStepResult (fetched later).
      runs: slot -> run that occupied the slot when the dispatch was issued.
      version: params version the dispatch decoded with.
      standby: standby row -> run staged there when the dispatch was issued.
      issued_at: time.monotonic() at issue.
    """

    result: MultiStepResult
    runs: dict[int, _Running]
    version: int
    standby: dict[int, _Running] = dataclasses.field(default_factory=dict)
    issued_at: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class Recorded:
    """What a fetched dispatch did to its runs (``record_dispatch``).

    Attributes:
      finished: (slot, run, "stop" | "length") for each active run that finished in the dispatch.
      appended: tokens appended to runs.
      placed: standby row -> slot, for the rows the dispatch moved into slots, in the order they moved.
      occupants: slot -> the run in it after the dispatch, for the slots a standby row moved into.
    """

    finished: list[tuple[int, _Running, FinishReason]]
    appended: int
    placed: dict[int, int]
    occupants: dict[int, _Running]


def record_dispatch(r: MultiStepResult, runs: dict[int, _Running], version: int,
                    standby: dict[int, _Running] | None = None) -> Recorded:
    """Append a fetched dispatch's tokens to the runs that are still active.

    Args:
      r: host (numpy) MultiStepResult, [K, S] buffers.
      runs: the dispatch's slot -> run snapshot.
      version: the params version the dispatch decoded with.
      standby: the dispatch's standby row -> run snapshot; a row the dispatch moved into a slot starts a
        new span of that slot at its ``placed_step`` (the previous occupant had finished by then).

    The first token a run gets here was sampled from logits computed before the dispatch (tagged with
    ``run.logits_version``: its prefill's version for a run placed from the standby); every later one
    from logits of this dispatch's params (``version``). A result with routes (``MultiStepResult.routes``) also
    appends each run's tokens' experts to ``run.routes``.
    """
    k, s = np.asarray(r.valid).shape
    valid = np.asarray(r.valid).T
    # Python lists once, not a numpy call per slot: [S][K] tokens and log-probs, [S][K + 1] counts of valid steps
    tokens, logprobs = np.asarray(r.tokens).T.tolist(), np.asarray(r.logprobs).T.tolist()
    routes = None if r.routes is None else np.swapaxes(np.asarray(r.routes), 0, 1)  # [S, K, L_moe, k]
    counts = np.concatenate([np.zeros((s, 1), np.int64), np.cumsum(valid, axis=1)], axis=1).tolist()
    done = np.asarray(r.done).tolist()
    spans: dict[int, list[tuple[int, _Running]]] = {slot: [(0, run)] for slot, run in runs.items()}
    placed: dict[int, int] = {}
    for row, run in sorted((standby or {}).items(), key=lambda item: int(r.placed_step[item[0]])):
        slot = int(r.placed_slot[row])
        if slot < s:
            placed[row] = slot
            spans.setdefault(slot, []).append((int(r.placed_step[row]), run))
    out = Recorded([], 0, placed, {})
    moved_into = set(placed.values())
    for slot, span in spans.items():
        span.sort(key=lambda x: x[0])
        if slot in moved_into:
            out.occupants[slot] = span[-1][1]
        for i, (start, run) in enumerate(span):
            if not run.active:
                continue
            end = span[i + 1][0] if i + 1 < len(span) else k
            n = counts[slot][end] - counts[slot][start]  # the valid steps of a span are a prefix of it
            if n:
                run.tokens.extend(tokens[slot][start:start + n])
                run.logprobs.extend(logprobs[slot][start:start + n])
                if routes is not None:  # a copy: a view would keep the whole dispatch's buffer alive
                    run.routes.append(routes[slot, start:start + n].copy())
                run.versions.append(run.logits_version)
                run.versions.extend([version] * (n - 1))
                run.logits_version = version
                out.appended += n
            if i + 1 < len(span) or done[slot]:
                last = run.tokens[-1] if run.tokens else None
                out.finished.append((slot, run, "stop" if last in run.sampling.stop_token_ids else "length"))
    return out
