"""TrajectoryBuffer: complete GRPO groups handed to the trainer in admission order.

Groups are numbered by admission (gid 0, 1, 2, ...). The trainer takes the next B *accepted* groups in
that order, skipping filtered ones and waiting for the head of the line if it is still generating.

Why strict admission order: the controller admits group number n (counting accepted + running) only
while n < (eta + v + 1) * B, where v is the sampler's params version at admission. Handing groups out
in admission order puts group n into batch floor(n / B) <= eta + v, i.e. it is trained at trainer
version <= v + eta, while each of its tokens was produced by params of version >= v. So no trained
token is ever more than eta versions old, even when a straggler finishes long after later groups;
taking groups in completion order would break that bound. With eta >= 1 the wait for a straggler is
not idle time: the sampler keeps generating the next batches meanwhile.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from areal_jax.system.interfaces import SampledCompletion

if TYPE_CHECKING:
    from areal_jax.data.prompts import PromptExample


@dataclasses.dataclass
class Group:
    """One prompt's samples, with rewards and advantages once complete.

    completions: the sampler's Completions (len group_size); rewards, advantages: [group_size] float32;
    reward_status: the reward pool's status per sample ("ok", "error", "timeout", "nan", "sampler_error").
    """

    gid: int
    example: PromptExample
    admit_version: int
    completions: list[SampledCompletion]
    rewards: np.ndarray
    reward_status: list[str]
    advantages: np.ndarray
    filtered: bool = False
    filter_reason: str = ""
    shaped_rewards: np.ndarray | None = None  # [group_size] what the advantages used (None: rewards)
    token_advantages: list | None = None  # per sample: float32 [N] per-token advantages, or None (multi-turn)


class TrajectoryBuffer:
    """Thread-safe store of groups keyed by admission number; hands out batches in that order."""

    def __init__(self, first_gid: int = 0):
        self._cond = threading.Condition()
        self._groups: dict[int, Group] = {}  # complete (accepted or filtered), not yet consumed
        self._admitted: set[int] = set()  # admitted, not yet complete
        self._next_gid = first_gid  # head of the line
        self._closed_error: BaseException | None = None
        self.consumed_groups = 0
        self.filtered_groups = 0

    def admitted(self, gid: int) -> None:
        with self._cond:
            self._admitted.add(gid)

    def complete(self, group: Group) -> None:
        with self._cond:
            self._admitted.discard(group.gid)
            self._groups[group.gid] = group
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Wake any waiting consumer with `error` (the producer died)."""
        with self._cond:
            self._closed_error = error
            self._cond.notify_all()

    def _ready_batch(self, n: int) -> list[int] | None:
        gid, taken = self._next_gid, []
        while len(taken) < n:
            if gid in self._groups:
                if not self._groups[gid].filtered:
                    taken.append(gid)
                gid += 1
            elif gid in self._admitted:
                return None  # head of the line still generating
            else:
                return None  # not admitted yet
        return taken

    def get_batch(self, n: int, timeout: float | None = None) -> list[Group] | None:
        """Block until the next `n` accepted groups (admission order) are complete; None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed_error is not None:
                    raise RuntimeError("the rollout side stopped with an error") from self._closed_error
                taken = self._ready_batch(n)
                if taken is not None:
                    last = taken[-1]
                    out = [self._groups[g] for g in taken]
                    for g in range(self._next_gid, last + 1):
                        grp = self._groups.pop(g)
                        self.filtered_groups += int(grp.filtered)
                    self._next_gid = last + 1
                    self.consumed_groups += n
                    return out
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))

    @property
    def next_gid(self) -> int:
        with self._cond:
            return self._next_gid

    def pending_gids(self) -> list[int]:
        """Admitted groups not yet handed to the trainer (complete or not), in admission order."""
        with self._cond:
            return sorted(set(self._groups) | self._admitted)

    def peek(self, gid: int) -> Group | None:
        """The complete group `gid` if it is waiting in the buffer, else None."""
        with self._cond:
            return self._groups.get(gid)

    def sizes(self) -> dict[str, int]:
        with self._cond:
            ready = sum(1 for g in self._groups.values() if not g.filtered)
            return {"buffer_ready_groups": ready, "buffer_generating_groups": len(self._admitted)}
