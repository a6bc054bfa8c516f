"""Random trainer inputs for tests: trajectories of random tokens with plausible behaviour log-probs."""
from __future__ import annotations

import numpy as np

from areal_jax.trainer.batch import Trajectory


def random_trajectories(n: int, *, vocab: int, seed: int = 0, min_len: int = 6, max_len: int = 20,
                        version: int = 0, dropped_fraction: float = 0.0) -> list[Trajectory]:
    """``n`` trajectories from one numpy Generator(seed): length L uniform in [min_len, max_len), prompt length
    uniform in [1, L - 1), tokens uniform in [3, vocab), behaviour log-probs ~ N(-4.6, 0.3) (about a uniform
    policy over 100 tokens), advantage ~ N(0, 1), reward 0, every completion token of policy ``version``.
    With ``dropped_fraction`` > 0 each completion token leaves the loss (loss_mask 0) with that probability;
    else the mask is all ones. Draws happen in that order per trajectory, so a seed gives the same batch."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len))
        prompt = int(rng.integers(1, length - 1))
        c = length - prompt
        tokens = rng.integers(3, vocab, length)
        behav_logp = rng.normal(-4.6, 0.3, c)
        advantage = float(rng.normal())
        mask = (rng.random(c) > dropped_fraction) if dropped_fraction > 0 else np.ones(c)
        out.append(Trajectory(tokens=tokens, prompt_len=prompt, behav_logp=behav_logp,
                              versions=np.full(c, version, np.int64), advantage=advantage, reward=0.0,
                              loss_mask=mask.astype(np.float32)))
    return out
