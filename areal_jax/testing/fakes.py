"""Small stand-ins for the controller's collaborators in tests: a prompt, a finished sample, a score,
a sampler's completion queue and a reward pool that scores by a rule.

They carry only the fields the controller reads (system.interfaces): `FakeExample` for a
data.PromptExample, `FakeCompletion` for a sampler's SampledCompletion, `FakeScore` for a reward
pool's result.
"""
from __future__ import annotations

import dataclasses
import queue
from typing import Callable

import numpy as np


@dataclasses.dataclass
class FakeExample:
    uid: str
    prompt_tokens: list
    answer: str = "1"
    question: str = ""


@dataclasses.dataclass
class FakeCompletion:
    request_id: int
    sample_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str = "stop"


@dataclasses.dataclass
class FakeScore:
    key: tuple
    reward: float
    status: str = "ok"
    seconds: float = 0.0


class QueuedCompletions:
    """The completion side of a sampler: subclasses put FakeCompletions on `self.out`."""

    current_version = 0

    def __init__(self):
        self.out: queue.Queue = queue.Queue()

    def get_completion(self, timeout: float | None = None) -> FakeCompletion | None:
        try:
            return self.out.get(timeout=timeout) if timeout else self.out.get_nowait()
        except queue.Empty:
            return None


class RuleRewards:
    """A reward pool that scores each submitted sample at once with `rule(key, text, answer)`."""

    def __init__(self, rule: Callable[[tuple, str, str], float]):
        self.rule = rule
        self.ready: queue.Queue = queue.Queue()

    def submit(self, key: tuple, text: str, answer: str) -> None:
        self.ready.put(FakeScore(key, float(self.rule(key, text, answer))))

    def results(self, timeout: float | None = None) -> list[FakeScore]:
        out = []
        while True:
            try:
                out.append(self.ready.get_nowait())
            except queue.Empty:
                return out
