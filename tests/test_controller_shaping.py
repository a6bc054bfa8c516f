"""DAPO's overlong penalty as reward shaping, end to end through the RolloutController: completions of
hand-picked lengths, rewards from a fake pool, the group's advantages and the trainer trajectories checked
against hand-worked numbers."""
import dataclasses

import numpy as np
import pytest

from areal_jax.knobs import ConfigError
from areal_jax.sampler.config import RolloutConfig
from areal_jax.system.buffer import TrajectoryBuffer
from areal_jax.system.controller import RolloutController
from areal_jax.system.runner import groups_to_trajectories
from areal_jax.testing.fakes import FakeCompletion, FakeExample, QueuedCompletions, RuleRewards
from areal_jax.testing.prompts import ListPrompts


class LengthSampler(QueuedCompletions):
    """Answers every request at once with completions of the given lengths."""

    def __init__(self, lengths):
        super().__init__()
        self.lengths = lengths

    def submit(self, req):
        for i, n in enumerate(self.lengths[: req.n]):
            reason = "length" if n == req.max_new_tokens else "stop"
            self.out.put(FakeCompletion(req.id, i, np.arange(3, 3 + n), np.full(n, -1.0), np.zeros(n, np.int32),
                                        reason))


def run_one_group(config, lengths, scores):
    buffer = TrajectoryBuffer()
    ctl = RolloutController(config, LengthSampler(lengths), RuleRewards(lambda key, text, answer: scores[key[1]]),
                            ListPrompts([FakeExample("u0", [1, 2], "x")]),
                            lambda ids: "text", buffer, batch_groups=1)
    assert ctl._admit() == 1
    ctl._drain_sampler()
    ctl._drain_rewards()
    (group,) = buffer.get_batch(1, timeout=1.0)
    return group


def test_overlong_penalty_shapes_the_advantages_and_the_trajectory_rewards():
    # max_new_tokens 10, buffer 4: no penalty up to 6 tokens, then -0.25 per token down to -1 at 10.
    # lengths 4, 7, 8, 10 -> penalties 0, -0.25, -0.5, -1; scores 1, 1, 0, 1 -> shaped 1, 0.75, -0.5, 0.
    # GRPO: mean 0.3125; deviations 0.6875, 0.4375, -0.8125, -0.3125; population std
    # sqrt((0.47265625 + 0.19140625 + 0.66015625 + 0.09765625) / 4) = sqrt(0.35546875) = 0.596212...
    config = RolloutConfig(group_size=4, max_new_tokens=10, num_slots=4, overlong_buffer=4, overlong_penalty=1.0)
    group = run_one_group(config, [4, 7, 8, 10], [1.0, 1.0, 0.0, 1.0])
    shaped = np.array([1.0, 0.75, -0.5, 0.0])
    std = np.sqrt(0.35546875)
    np.testing.assert_allclose(group.shaped_rewards, shaped, atol=1e-6)
    np.testing.assert_allclose(group.advantages, (shaped - 0.3125) / (std + 1e-6), rtol=1e-5)
    np.testing.assert_array_equal(group.rewards, [1.0, 1.0, 0.0, 1.0])  # the pool's scores stay as they were
    trajs = groups_to_trajectories([group])
    np.testing.assert_allclose([t.reward for t in trajs], shaped, atol=1e-6)  # a critic's terminal reward
    np.testing.assert_allclose([t.advantage for t in trajs], group.advantages)
    # A factor of 0.5 halves each penalty: shaped 1, 0.875, -0.25, 0.5.
    half = run_one_group(dataclasses.replace(config, overlong_penalty=0.5), [4, 7, 8, 10], [1.0, 1.0, 0.0, 1.0])
    np.testing.assert_allclose(half.shaped_rewards, [1.0, 0.875, -0.25, 0.5], atol=1e-6)


def test_overlong_penalty_is_off_by_default_and_checked():
    config = RolloutConfig(group_size=4, max_new_tokens=10, num_slots=4)
    group = run_one_group(config, [4, 7, 8, 10], [1.0, 1.0, 0.0, 1.0])
    np.testing.assert_array_equal(group.shaped_rewards, group.rewards)
    # Default GRPO on the raw scores: mean 0.75, std sqrt(0.1875).
    np.testing.assert_allclose(group.advantages, (np.array([1, 1, 0, 1]) - 0.75) / (np.sqrt(0.1875) + 1e-6), rtol=1e-5)
    with pytest.raises(ConfigError, match=r"--config\.rollout\.overlong_buffer=11"):
        RolloutConfig(max_new_tokens=10, overlong_buffer=11)
