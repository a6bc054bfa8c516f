"""rollout.advantage_mode=rank: centred ranks within each group, checked against hand-worked numbers, its
invariances, and end to end from the config through the RolloutController to the trajectory buffer."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from areal_jax import config as config_lib
from areal_jax.config import ConfigError
from areal_jax.rl.advantages import group_advantages
from areal_jax.system.buffer import TrajectoryBuffer
from areal_jax.system.controller import RolloutController
from areal_jax.testing.prompts import ListPrompts
from tests.test_interfaces import Example, ScriptedSampler


def test_rank_by_hand():
    # Group 1 sorted: 0.2, 0.2 (0-based ranks 0 and 1 -> mean 0.5), 0.5 (rank 2), 1.0 (rank 3); n - 1 = 3.
    # Group 2: identical rewards -> zeros. Group 3: 0, 1, 0, 0 -> the zeros share rank 1, the one has rank 3.
    rewards = [0.2, 1.0, 0.2, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    want = [0.5 / 3 - 0.5, 0.5, 0.5 / 3 - 0.5, 2 / 3 - 0.5, 0, 0, 0, 0, 1 / 3 - 0.5, 0.5, 1 / 3 - 0.5, 1 / 3 - 0.5]
    got = np.asarray(group_advantages(np.asarray(rewards, np.float32), 4, mode="rank"))
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert got[4:8].tolist() == [0.0] * 4  # exact zeros for a uniform group


def test_rank_invariances():
    rng = np.random.default_rng(0)
    r = rng.random(6 * 8).astype(np.float32)
    base = np.asarray(group_advantages(r, 8, mode="rank"))
    np.testing.assert_allclose(np.asarray(group_advantages(r ** 3 * 10 + 5, 8, mode="rank")), base, atol=1e-6)
    np.testing.assert_allclose(base.reshape(6, 8).sum(axis=1), 0.0, atol=1e-6)  # centred per group
    assert base.min() == pytest.approx(-0.5) and base.max() == pytest.approx(0.5)  # distinct rewards
    binary = (rng.random(5 * 8) < 0.4).astype(np.float32)
    np.testing.assert_allclose(np.asarray(group_advantages(binary, 8, mode="rank")),
                               np.asarray(group_advantages(binary, 8, mode="dr_grpo")) * 8 / (2 * 7), atol=1e-6)
    with pytest.raises(ValueError, match="mode='rank' needs group_size >= 2"):
        group_advantages(np.zeros(3), 1, mode="rank")


class GradedRewards:
    """Reward of sample i: (i % 3) / 2, so each group of 4 scores 0, 0.5, 1, 0."""

    def __init__(self):
        self.pending: list = []

    def submit(self, key, completion: str, answer: str) -> None:
        self.pending.append(dataclasses.make_dataclass("R", ["key", "reward", "status", "seconds"])(
            key, (key[1] % 3) / 2, "ok", 0.0))

    def results(self, timeout: float | None = None) -> list:
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        pass


def test_rank_from_the_config_through_the_controller():
    c = config_lib.base_config()
    c.rollout.advantage_mode = "rank"
    c.rollout.group_size = 4
    job = config_lib.validate(c, check_paths=False)
    assert job.rollout.advantage_mode == "rank" and "rank" in config_lib.config_docs()["rollout.advantage_mode"]
    c.rollout.advantage_mode = "ranks"
    with pytest.raises(ConfigError, match=r"--config\.rollout\.advantage_mode='ranks' is not one of grpo, dr_grpo, "
                                          r"rloo, rank\."):
        config_lib.validate(c, check_paths=False)

    sampler, buffer = ScriptedSampler(), TrajectoryBuffer()
    ctl = RolloutController(job.rollout, sampler, GradedRewards(), ListPrompts([Example("p", [1, 2], "1")]),
                            lambda t: "x", buffer, batch_groups=1)
    ctl._admit()
    sampler.finish(sampler.requests[0])
    ctl._drain_sampler()
    ctl._drain_rewards()
    (group,) = buffer.get_batch(1, timeout=0)
    # Rewards 0, 0.5, 1, 0: the zeros share rank 0.5, then ranks 2 and 3; / 3 - 1/2.
    np.testing.assert_allclose(group.rewards, [0.0, 0.5, 1.0, 0.0])
    np.testing.assert_allclose(group.advantages, [0.5 / 3 - 0.5, 2 / 3 - 0.5, 0.5, 0.5 / 3 - 0.5], atol=1e-6)
