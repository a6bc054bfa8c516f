"""RolloutController + TrajectoryBuffer against a simulated sampler with stragglers.

The fake sampler finishes requests in random order (some take many trainer versions: stragglers) and
tags each token with the version current when it was "generated". The property checked is the paper's:
no trained token is more than eta versions older than the trainer that trains it; plus every group is
trained exactly once, in admission order, and filtered groups are never trained.
"""
import random
import threading

import numpy as np
import pytest

from areal_jax.sampler.config import RolloutConfig
from areal_jax.system.buffer import TrajectoryBuffer
from areal_jax.system.controller import RolloutController
from areal_jax.testing.fakes import FakeCompletion, FakeExample, QueuedCompletions, RuleRewards
from areal_jax.testing.prompts import ListPrompts


class FakeSampler(QueuedCompletions):
    """Generates each sample's tokens one per tick at the current version; some requests stall."""

    def __init__(self, rng):
        super().__init__()
        self.rng = rng
        self.current_version = 0
        self.lock = threading.Lock()
        self.active = []  # [request, sample_index, tokens_so_far(list of versions), target_len]

    def submit(self, req):
        with self.lock:
            for i in range(req.n):
                # 15% stragglers take ~10x longer
                length = self.rng.randint(1, 4) * (10 if self.rng.random() < 0.15 else 1)
                self.active.append([req, i, [], length])

    def tick(self):
        with self.lock:
            for item in list(self.active):
                if self.rng.random() < 0.5:
                    item[2].append(self.current_version)
                if len(item[2]) >= item[3]:
                    self.active.remove(item)
                    req, i, versions, _ = item
                    self.out.put(FakeCompletion(req.id, i, np.arange(len(versions)), np.zeros(len(versions)),
                                                np.asarray(versions)))


def FakeRewards(rng, uniform_share=0.0):  # noqa: N802 (stands in for a class)
    # groups whose gid % 5 == 0 get all-equal rewards (filtered when filtering is on)
    return RuleRewards(lambda key, text, answer: 1.0 if key[0] % 5 == 0 and uniform_share
                       else float(rng.random() < 0.5))


def _run(eta, batch_groups=3, group_size=2, steps=12, seed=0, filter_uniform=False):
    rng = random.Random(seed)
    sampler = FakeSampler(rng)
    rewards = FakeRewards(random.Random(seed + 1), uniform_share=1.0 if filter_uniform else 0.0)
    prompts = ListPrompts(FakeExample(f"p{i}", [1, 2, 3], "1") for i in range(10_000))
    buffer = TrajectoryBuffer()
    settings = RolloutConfig(group_size=group_size, max_new_tokens=8, max_staleness=eta,
                             max_concurrent=None if eta is not None else 8, filter_uniform_groups=filter_uniform)
    ctl = RolloutController(settings, sampler, rewards, prompts, lambda t: "x", buffer, batch_groups=batch_groups).start()
    trained, max_stale = [], 0
    try:
        for version in range(steps):
            while True:
                groups = buffer.get_batch(batch_groups, timeout=0.001)
                if groups is not None:
                    break
                ctl.check()
                sampler.tick()
            for g in groups:
                assert not g.filtered
                for c in g.completions:
                    stale = version - int(np.min(c.versions))
                    max_stale = max(max_stale, stale)
                    if eta is not None:
                        assert stale <= eta, f"group {g.gid} trained at v{version} holds a v{c.versions.min()} token"
                trained.append(g.gid)
            for _ in range(rng.randint(0, 3)):  # the trainer takes a while; generation goes on
                sampler.tick()
            sampler.current_version = version + 1  # publish
    finally:
        ctl.stop()
    return trained, max_stale, ctl


@pytest.mark.parametrize("eta", [0, 1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_staleness_bound_holds_with_stragglers(eta, seed):
    trained, max_stale, ctl = _run(eta, seed=seed)
    assert trained == sorted(trained) and len(set(trained)) == len(trained)  # admission order, once each
    assert trained == list(range(len(trained)))
    if eta == 0:
        assert max_stale == 0


def test_eta_zero_admits_only_the_next_batch():
    rng = random.Random(0)
    sampler = FakeSampler(rng)
    buffer = TrajectoryBuffer()
    settings = RolloutConfig(group_size=2, max_new_tokens=8, max_staleness=0)
    prompts = ListPrompts(FakeExample(f"p{i}", [1], "1") for i in range(100))
    ctl = RolloutController(settings, sampler, FakeRewards(rng), prompts, lambda t: "x", buffer, batch_groups=3)
    assert ctl._admit() == 3 and ctl._admit() == 0  # (0 + 0 + 1) * 3 groups, then no capacity


def test_uniform_groups_are_filtered_and_never_trained():
    trained, _, ctl = _run(eta=2, seed=3, filter_uniform=True)
    assert all(gid % 5 != 0 for gid in trained)
    assert ctl.counters["filtered_uniform_rewards"] > 0


def test_unbounded_eta_uses_max_concurrent():
    trained, _, ctl = _run(eta=None, seed=4)
    assert len(trained) == 12 * 3
