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
      issued_at: time.monotonic() at issue.
    """

    result: MultiStepResult
    runs: dict[int, _Running]
    version: int
    issued_at: float = dataclasses.field(default_factory=time.monotonic)


def record_dispatch(r: MultiStepResult, runs: dict[int, _Running],
                    version: int) -> tuple[list[tuple[int, FinishReason]], int]:
    """Append a fetched dispatch's tokens to the runs that are still active.

    Args:
      r: host (numpy) MultiStepResult, [K, S] buffers.
      runs: the dispatch's slot -> run snapshot.
      version: the params version the dispatch decoded with.

    The first token a run gets here was sampled from logits computed before the dispatch (tagged with
    ``run.logits_version``); every later one from logits of this dispatch's params (``version``).

    Returns:
      (finished: [(slot, "stop" | "length")] for active runs whose slot finished in the dispatch,
       appended: number of tokens appended).
    """
    counts = np.asarray(r.valid).sum(axis=0)  # the valid steps of a slot are a prefix of the K
    tokens, logprobs = np.asarray(r.tokens).T, np.asarray(r.logprobs).T
    finished: list[tuple[int, FinishReason]] = []
    appended = 0
    for slot, run in runs.items():
        if not run.active:
            continue
        n = int(counts[slot])
        if n:
            new = tokens[slot, :n].tolist()
            run.tokens.extend(new)
            run.logprobs.extend(logprobs[slot, :n].tolist())
            run.versions.append(run.logits_version)
            run.versions.extend([version] * (n - 1))
            run.logits_version = version
            appended += n
        if r.done[slot]:
            last = run.tokens[-1] if run.tokens else None
            finished.append((slot, "stop" if last in run.sampling.stop_token_ids else "length"))
    return finished, appended
