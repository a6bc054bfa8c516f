"""What callers hand to the sampler loop and what it hands back."""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Literal, Sequence

import numpy as np

from areal_jax.sampler.sampling import SamplingParams
from areal_jax.sampler.state import Prefix

FinishReason = Literal["stop", "length", "interrupted", "error"]


@dataclasses.dataclass(frozen=True)
class Request:
    """n samples of one prompt. ``top_k`` / ``top_p`` None means off; temperature 0 means greedy."""

    id: Hashable
    prompt: Sequence[int]
    max_new_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: Sequence[int] = ()


@dataclasses.dataclass
class Completion:
    """One finished sample.

    Attributes:
      tokens: [N] int32 generated ids (a stop token, when hit, is the last one).
      logprobs: [N] float32 behaviour log-probabilities of ``tokens``.
      versions: [N] int32 params version that produced each token.
      finish_reason: "stop" | "length" | "interrupted" | "error"; ``error`` says what went wrong.
      loss_mask: [N] float32, which tokens enter the loss (None: all); a multi-turn sample's feedback tokens are 0.
      turns: [N] int32, a multi-turn sample's turn of each token (0: the first attempt; a feedback counts with the
        attempt after it); None: one turn.
      routes: [P + N, L_moe, k] (uint8 up to 256 experts: `moe.routes_dtype`), a mixture-of-experts model's experts of every prompt and generated token in
        each expert layer, as the sampler's prefill and decode steps chose them (SamplerLoop(record_routes=True);
        `sampler.routes`); None: not recorded.
    """

    request_id: Hashable
    sample_index: int
    prompt: list[int]
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    error: str | None = None
    loss_mask: np.ndarray | None = None
    turns: np.ndarray | None = None
    routes: np.ndarray | None = None


class SamplerLoopError(RuntimeError):
    """The sampler thread failed; the original exception is the ``__cause__``."""


def make_completion(request: Request, index: int, tokens: Sequence[int] = (), logprobs: Sequence[float] = (),
                versions: Sequence[int] = (), reason: FinishReason = "interrupted",
                error: str | None = None) -> Completion:
    return Completion(request.id, index, list(request.prompt), np.asarray(tokens, np.int32),
                      np.asarray(logprobs, np.float32), np.asarray(versions, np.int32), reason, error)


@dataclasses.dataclass
class _Queued:
    """A request waiting for slots (the loop's bookkeeping); its prefix is reused across its samples."""

    request: Request
    sampling: SamplingParams
    next_index: int = 0
    prefix: Prefix | None = None
    prefix_version: int = -1
    routes: Any = None  # the prefix's prompt routes [P, L_moe, k] (record_routes; sampler.routes.split_routes)
    resume: _Running | None = None  # a preempted sample (sampler.preempt): this one sample, its tokens so far

    @property
    def remaining(self) -> int:
        """Samples still to admit."""
        return 1 if self.resume is not None else self.request.n - self.next_index

    def interrupted(self) -> list[Completion]:
        """The samples still to admit, handed back as "interrupted" (a preempted one with what it generated)."""
        if self.resume is not None:
            run = self.resume
            run.active = False
            return [make_completion(self.request, run.sample_index, run.tokens, run.logprobs, run.versions)]
        return [make_completion(self.request, i) for i in range(self.next_index, self.request.n)]


@dataclasses.dataclass
class _Running:
    """One sample decoding in a slot: what it produced so far and the version of its next logits."""

    request: Request
    sample_index: int
    sampling: SamplingParams
    logits_version: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    prompt_routes: Any = None  # record_routes: [P, L_moe, k] of the prefill that drew the first token
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)  # record_routes: the decoded tokens', per dispatch
    active: bool = True  # False once handed back; results of dispatches still in flight are then dropped
