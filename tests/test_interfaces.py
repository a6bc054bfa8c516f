"""The system's collaborator protocols: the real classes fit them, and the controller runs on any sampler that does.

Each protocol method of system/interfaces.py is compared with the implementation's signature (same
parameter names, kinds and defaults; extra parameters only with defaults), beside the isinstance check
that runtime_checkable makes (which only sees that the members exist).
"""
from __future__ import annotations

import dataclasses
import inspect
import queue

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.sampler import Completion, Engine, Request, SamplerLoop
from areal_jax.sampler.config import RolloutConfig
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.system import interfaces
from areal_jax.system.buffer import TrajectoryBuffer
from areal_jax.system.controller import RolloutController
from areal_jax.system.loadgen import ForcedLengths
from areal_jax.testing import models as testing
from areal_jax.testing.prompts import ListPrompts
from areal_jax.timeline import SpanRecorder, Timeline


def protocol_members(protocol: type) -> dict[str, object]:
    """Own and inherited members a protocol declares (methods and properties), by name."""
    out: dict[str, object] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if (callable(value) or isinstance(value, property)) and (not name.startswith("_") or name in (
                    "__iter__", "__next__")):
                out[name] = value
    return out


def assert_signatures_fit(cls: type, protocol: type) -> None:
    """Every protocol method exists on cls with the protocol's parameters (names, kinds, defaults) in
    order; extra trailing parameters must have defaults; properties stay properties."""
    for name, member in protocol_members(protocol).items():
        impl = inspect.getattr_static(cls, name, None)
        assert impl is not None, f"{cls.__name__} lacks {protocol.__name__}.{name}"
        if isinstance(member, property):
            assert isinstance(impl, property), f"{cls.__name__}.{name} must be a property"
            continue
        want = list(inspect.signature(member).parameters.values())
        got = list(inspect.signature(impl).parameters.values())
        assert len(got) >= len(want), f"{cls.__name__}.{name}{inspect.signature(impl)} takes fewer parameters"
        for w, g in zip(want, got):
            assert (g.name, g.kind) == (w.name, w.kind), f"{cls.__name__}.{name}: {g} where {protocol.__name__} has {w}"
            assert g.default == w.default, f"{cls.__name__}.{name}: default of {g.name} is {g.default!r}, not {w.default!r}"
        for g in got[len(want):]:
            assert g.default is not inspect.Parameter.empty or g.kind in (g.VAR_POSITIONAL, g.VAR_KEYWORD), (
                f"{cls.__name__}.{name}: extra parameter {g.name} has no default")


def test_signature_check_rejects_a_mismatch():
    class WrongSampler:  # timeout without its default, and a renamed parameter
        current_version = property(lambda self: 0)

        def submit(self, req): ...

        def get_completion(self, timeout): ...

    assert isinstance(WrongSampler(), interfaces.RolloutSampler)  # runtime_checkable only sees the names
    with pytest.raises(AssertionError, match="submit"):
        assert_signatures_fit(WrongSampler, interfaces.RolloutSampler)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_sampler_loop_is_a_managed_sampler(paged):
    model = testing.random_model(testing.tiny_config("qwen2"), seed=0)
    engine = (PagedEngine(model, num_slots=2, max_len=24, page_size=8, num_pages=6) if paged
              else Engine(model, num_slots=2, max_len=24))
    loop = SamplerLoop(engine, nnx.split(model)[1])
    try:
        assert isinstance(loop, interfaces.ManagedSampler) and isinstance(loop, interfaces.RolloutSampler)
        loop.submit(Request(id="a", prompt=[3, 4, 5], max_new_tokens=3, temperature=0.0))
        c = loop.get_completion(timeout=120)
        assert isinstance(c, interfaces.SampledCompletion) and len(c.tokens) == len(c.versions) == 3
        loop.check()  # a healthy loop raises nothing
        version, params = loop.versioned_params()
        assert version == loop.current_version == 0
        # The same buffers the loop decodes with (not copies), rebuilt as the model's nnx.State.
        assert jax.tree.structure(params) == jax.tree.structure(nnx.split(model)[1])
        assert all(a is b for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loop.params)))
        assert loop.stats()["generated_tokens"] == 3
    finally:
        loop.stop(graceful=False)
    assert_signatures_fit(SamplerLoop, interfaces.ManagedSampler)


def test_sampler_replicas_are_a_managed_sampler():
    from areal_jax.sampler.replicas import SamplerReplicas

    model = testing.random_model(testing.tiny_config("qwen2"), seed=0)
    engines = [Engine(model, num_slots=2, max_len=24) for _ in range(2)]  # no mesh: both on the default device
    sampler = SamplerReplicas(engines, nnx.split(model)[1])
    try:
        assert isinstance(sampler, interfaces.ManagedSampler)
        for i in range(3):
            sampler.submit(Request(id=i, prompt=[3, 4, 5 + i], max_new_tokens=3, temperature=0.0))
        done = [sampler.get_completion(timeout=120) for _ in range(3)]
        assert sorted(c.request_id for c in done) == [0, 1, 2]
        assert sampler.stats()["generated_tokens"] == 9 and sampler.current_version == 0
        sampler.check()
    finally:
        sampler.stop(graceful=False)
    assert_signatures_fit(SamplerReplicas, interfaces.ManagedSampler)


def test_reward_pool_prompt_iterator_forced_lengths_and_timeline_fit(tmp_path):
    from areal_jax.data import make_prompt_iterator
    from areal_jax.rewards.pool import RewardPool, RewardResult
    from areal_jax.testing.tiny import write_tiny_assets
    from areal_jax.tokenizer import Tokenizer

    assert_signatures_fit(RewardPool, interfaces.RewardService)
    with RewardPool("areal_jax.rewards.exact:exact_match_reward", num_workers=1, timeout_s=30.0) as pool:
        assert isinstance(pool, interfaces.RewardService)
        pool.submit("k", "#### 7", "7")
        got = []
        while not got:
            got = pool.results(timeout=60.0)
        assert isinstance(got[0], interfaces.ScoredSample) and (got[0].key, got[0].reward) == ("k", 1.0)
    assert isinstance(RewardResult("k", 0.0, "ok", None, 0.1), interfaces.ScoredSample)

    from areal_jax.data.pipeline import PromptIterator

    assets = write_tiny_assets(str(tmp_path), n_train=4, n_test=2)
    prompts = make_prompt_iterator(assets["train"], Tokenizer.from_pretrained(assets["model"]), seed=0)
    assert isinstance(prompts, interfaces.PromptStream)
    assert_signatures_fit(PromptIterator, interfaces.PromptStream)
    assert_signatures_fit(ListPrompts, interfaces.PromptStream)

    assert isinstance(ForcedLengths(ScriptedSampler(), np.array([3])), interfaces.RolloutSampler)
    assert_signatures_fit(ForcedLengths, interfaces.RolloutSampler)
    assert_signatures_fit(Timeline, SpanRecorder)
    assert isinstance(Timeline(enabled=False), SpanRecorder)
    assert isinstance(Completion("r", 0, [1], np.zeros(1, np.int32), np.zeros(1), np.zeros(1, np.int32), "stop"),
                      interfaces.SampledCompletion)


def test_list_prompts_resumes_where_it_stopped():
    stream = ListPrompts(["a", "b", "c"])
    assert next(stream) == "a"
    state = stream.get_state()
    assert list(stream) == ["b", "c"]
    stream.set_state(state)
    assert next(stream) == "b"
    with pytest.raises(ValueError, match="Not a ListPrompts state"):
        stream.set_state({"next_index": 9})


# ---- the controller on a sampler written against the protocol -------------------------------------------


@dataclasses.dataclass
class Example:
    uid: str
    prompt_tokens: list
    answer: str
    question: str = ""


class ScriptedSampler(interfaces.RolloutSampler):
    """Finishes a sample only when the test says so, at the version the test sets; records admissions."""

    def __init__(self):
        self.version = 0
        self.requests: list[Request] = []
        self.out: queue.Queue = queue.Queue()

    @property
    def current_version(self) -> int:
        return self.version

    def submit(self, request: Request) -> None:
        self.requests.append(request)

    def get_completion(self, timeout: float | None = None) -> Completion | None:
        try:
            return self.out.get_nowait()
        except queue.Empty:
            return None

    def finish(self, request: Request) -> None:
        for i in range(request.n):
            length = 1 + (i % 3)
            self.out.put(Completion(request.id, i, list(request.prompt), np.arange(length, dtype=np.int32),
                                    np.zeros(length, np.float32), np.full(length, self.version, np.int32), "stop"))


class ScriptedRewards:
    """Reward of sample i of group g: 1.0 when (g + i) is even, else 0.0."""

    def __init__(self):
        self.pending: list = []

    def submit(self, key, completion: str, answer: str) -> None:
        gid, i = key
        self.pending.append(dataclasses.make_dataclass("R", ["key", "reward", "status", "seconds"])(
            key, float((gid + i) % 2 == 0), "ok", 0.0))

    def results(self, timeout: float | None = None) -> list:
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        pass


def test_controller_admits_by_the_staleness_rule_on_a_protocol_sampler():
    eta, batch, group = 1, 2, 4
    sampler, rewards = ScriptedSampler(), ScriptedRewards()
    assert isinstance(rewards, interfaces.RewardService)
    prompts = ListPrompts(Example(f"p{i}", [5, 6, i], str(i)) for i in range(50))
    buffer = TrajectoryBuffer()
    settings = RolloutConfig(group_size=group, max_new_tokens=4, max_staleness=eta)
    ctl = RolloutController(settings, sampler, rewards, prompts, lambda t: "x", buffer, batch_groups=batch)
    ctl._admit()
    # accepted + running < (eta + v + 1) * B: at v = 0, (1 + 0 + 1) * 2 = 4 groups, however many prompts wait.
    assert [r.id for r in sampler.requests] == [0, 1, 2, 3] and all(r.n == group for r in sampler.requests)
    ctl._admit()
    assert len(sampler.requests) == 4
    for r in sampler.requests[:2]:
        sampler.finish(r)
    ctl._drain_sampler()
    ctl._drain_rewards()
    batch0 = buffer.get_batch(batch, timeout=0)
    assert [g.gid for g in batch0] == [0, 1]
    for g in batch0:  # GRPO by hand: rewards alternate 1, 0 (or 0, 1): mean 0.5, std 0.5
        want = np.array([float((g.gid + i) % 2 == 0) for i in range(group)])
        np.testing.assert_allclose(g.rewards, want)
        np.testing.assert_allclose(g.advantages, (want - 0.5) / (0.5 + 1e-6), rtol=1e-5)
    ctl._admit()
    assert len(sampler.requests) == 4  # accepted 2 + running 2 = 4: still full at v = 0
    sampler.version = 1  # a new policy: room for one more batch
    ctl._admit()
    assert [r.id for r in sampler.requests[4:]] == [4, 5]
    snap = ctl.snapshot()
    assert [e.uid for e in snap["pending"]] == ["p2", "p3", "p4", "p5"] and snap["prompts_state"] == {"next_index": 6}


def test_controller_counts_errors_of_a_protocol_sampler():
    sampler, rewards = ScriptedSampler(), ScriptedRewards()
    ctl = RolloutController(RolloutConfig(group_size=2, max_new_tokens=4, max_staleness=0),
                            sampler, rewards, ListPrompts([Example("only", [1], "1")]), lambda t: "x",
                            TrajectoryBuffer(), batch_groups=1)
    ctl._admit()
    (req,) = sampler.requests
    for i in range(req.n):
        sampler.out.put(Completion(req.id, i, [1], np.zeros(0, np.int32), np.zeros(0, np.float32),
                                   np.zeros(0, np.int32), "error", "the prompt is too long"))
    ctl._drain_sampler()
    group = ctl.buffer.peek(0)
    assert group is not None and group.filtered and group.filter_reason == "sampler_error"
    assert ctl.counters["finish_error"] == 2 and ctl.accepted == 0 and ctl._admit() == 0  # the stream is exhausted
