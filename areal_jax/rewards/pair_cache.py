"""PairCache: identical (completion, answer) pairs scored once, for the RewardPool.

A pair already answered by the reward function (status "ok" or "nan") is answered again from an LRU of
``size`` pairs; a pair submitted while the same pair is waiting or being scored follows that one and
gets its result, whatever its status. Kills and crashes are never cached, so a later repeat runs again.
Pairs are keyed by a 128-bit digest, so the cache holds a few dozen bytes per pair however long the
completions and the tests are. Not thread-safe: the pool calls it under its lock. A policy that has
sharpened repeats itself: 29% of the code default's 1,800 evaluation completions repeat one already
seen, before any training.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Any, Iterable

Answer = tuple[float, str, "str | None"]  # (reward, status, error)
CACHED_STATUSES = ("ok", "nan")  # the reward function's own answers


def pair_digest(completion: str, answer: str) -> bytes:
    """A 128-bit digest of a (completion, answer) pair."""
    h = hashlib.blake2b(digest_size=16)
    for text in (completion, answer):
        data = str(text).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


class PairCache:
    """What to do with each new task of a pair (answer it, make it follow, or score it), and the
    followers a scored task releases. A task is any object; `key` is its pair digest (`pair_digest`)."""

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._answers: collections.OrderedDict[bytes, Answer] = collections.OrderedDict()  # LRU first
        self._leaders: dict[bytes, Any] = {}  # pair -> the task waiting or being scored for it
        self._followers: dict[int, list[Any]] = {}  # id(leader) -> later tasks of the same pair

    def admit(self, key: bytes, task: Any) -> tuple[Answer | None, bool]:
        """(cached answer or None, whether `task` must be scored itself). A task that gets neither
        follows the task already scoring its pair, and `settle` of that one releases it."""
        if key in self._answers:
            self._answers.move_to_end(key)
            return self._answers[key], False
        leader = self._leaders.get(key)
        if leader is not None:
            self._followers.setdefault(id(leader), []).append(task)
            return None, False
        self._leaders[key] = task
        return None, True

    def settle(self, key: bytes, task: Any, answer: Answer) -> Iterable[Any]:
        """Record `task`'s answer (cached when it is the reward's own) and return its followers."""
        if self._leaders.get(key) is task:
            del self._leaders[key]
            if answer[1] in CACHED_STATUSES:
                self._answers[key] = answer
                if len(self._answers) > self.size:
                    self._answers.popitem(last=False)
        return self._followers.pop(id(task), ())
