"""What orchestration needs of its collaborators: the rollout sampler, the reward service, the prompt stream.

Small structural interfaces (``typing.Protocol``) in the manner of JetStream's ``engine_api.py``: each
lists the calls the system makes, with units and shapes, and nothing else. The implementations do not
inherit from them (any object with these members fits), and the system never probes with ``hasattr``:

    protocol              what the system calls it for                 implemented by
    RolloutSampler        admission and draining (RolloutController)   sampler.SamplerLoop (dense or paged
                                                                       engine), system.loadgen.ForcedLengths
    ManagedSampler        + weights, health, counters, shut-down      sampler.SamplerLoop,
                          (RLJob, runner.wait_for_batch,               sampler.replicas.SamplerReplicas
                          ParamChannel.deliver)
    RewardService         scoring completions off the accelerator      rewards.RewardPool
    PromptStream          the next prompt, and its position for a      data.PromptIterator,
                          checkpoint                                   testing.prompts.ListPrompts
    ScoredSample          one reward result                            rewards.RewardResult
    SampledCompletion     one finished sample                          sampler.Completion

``runtime_checkable`` lets tests assert that the real classes fit (``isinstance`` checks that the members
exist; tests/test_interfaces.py also compares the signatures).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable, Iterator, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from flax import nnx

    from areal_jax.data.prompts import PromptExample
    from areal_jax.models import FlatParams
    from areal_jax.sampler.requests import Request

__all__ = ["ManagedSampler", "ParamsSink", "PromptStream", "RewardService", "RolloutSampler", "SampledCompletion",
           "ScoredSample"]

# Where a ParamChannel delivers each published version: called as sink(params_on_rollout, version),
# typically ManagedSampler.update_params; the params come held flat (areal_jax.models.FlatParams).
ParamsSink = Callable[["nnx.State", int], None]


@runtime_checkable
class SampledCompletion(Protocol):
    """One finished sample of a request, as the controller reads it.

    request_id: the id of the Request it answers (the controller uses the group number);
    sample_index: 0 .. n - 1 within the request;
    tokens: [T] int32 generated token ids (prompt excluded);
    logprobs: [T] float32 behaviour log-probabilities of those tokens;
    versions: [T] int32 policy version whose logits each token was sampled from;
    finish_reason: "stop", "length", "interrupted" or "error".
    """

    request_id: Hashable
    sample_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str


@runtime_checkable
class RolloutSampler(Protocol):
    """A sampler that takes requests and hands back finished samples, thread-safe.

    The controller submits one Request per group (n samples sharing one prompt) and drains completions
    in any order; ``current_version`` is what the staleness bound counts against.
    """

    @property
    def current_version(self) -> int:
        """Policy version of the params the sampler decodes with now (0 before the first update)."""
        ...

    def submit(self, request: Request) -> None:
        """Queue ``request`` (non-blocking). A request that cannot be served comes back as n completions
        with finish_reason "error", never as an exception from a later call."""
        ...

    def get_completion(self, timeout: float | None = None) -> SampledCompletion | None:
        """The next finished sample, waiting up to ``timeout`` seconds (None: until one arrives); None on
        timeout or once the sampler has stopped and every sample was handed back."""
        ...


@runtime_checkable
class ManagedSampler(RolloutSampler, Protocol):
    """A RolloutSampler run by a job: it takes new weights, reports failures and counters, and stops."""

    def update_params(self, params: nnx.State | FlatParams, version: int) -> None:
        """Swap in ``params`` (an nnx.State or the same held flat; already on the sampler's devices, same structure, shapes and dtypes as the
        current ones) as ``version`` at the next step boundary; non-blocking, the latest call wins."""
        ...

    def versioned_params(self) -> tuple[int, nnx.State]:
        """(version, params) the sampler decodes with now, read together."""
        ...

    def check(self) -> None:
        """Raise (in the caller's thread) the error that stopped the sampler's own thread, if any."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters since start: at least ``generated_tokens`` (int) and ``mean_slot_occupancy``
        (busy slot-steps / (steps * slots), in [0, 1])."""
        ...

    def stop(self, graceful: bool = True, timeout: float | None = None) -> None:
        """End the sampler's thread. graceful: finish what was submitted first; else in-flight samples
        come back as "interrupted". Waits up to ``timeout`` seconds (None: until it ended)."""
        ...


@runtime_checkable
class ScoredSample(Protocol):
    """One reward result: key as submitted, reward (0.0 unless status is "ok"), status ("ok", "error",
    "timeout", "nan") and seconds the reward function ran."""

    key: Hashable
    reward: float
    status: str
    seconds: float


@runtime_checkable
class RewardService(Protocol):
    """Scores (completion text, reference answer) pairs asynchronously, off the accelerator."""

    def submit(self, key: Hashable, completion: str, answer: str) -> None:
        """Queue one sample (non-blocking); its result comes back from ``results`` with this key."""
        ...

    def results(self, timeout: float | None = None) -> list[ScoredSample]:
        """Every result finished so far, in no particular order; when none is ready, wait up to ``timeout``
        seconds for one (None: until one arrives). [] when nothing is outstanding or on timeout."""
        ...

    def close(self) -> None:
        """Release the workers; no call is valid afterwards."""
        ...


@runtime_checkable
class PromptStream(Protocol):
    """An endless (or finite) iterator of prompts whose position can be saved and restored exactly."""

    def __iter__(self) -> Iterator[PromptExample]:
        ...

    def __next__(self) -> PromptExample:
        """The next prompt; StopIteration when a finite stream is exhausted."""
        ...

    def get_state(self) -> dict:
        """JSON-serialisable position just after the last prompt returned."""
        ...

    def set_state(self, state: dict) -> None:
        """Resume from ``get_state()`` output: the next prompt is the one that would have come next."""
        ...
