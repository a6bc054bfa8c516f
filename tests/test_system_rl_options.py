"""The RL options reachable from the config run end to end in the asynchronous job (tiny random model):
critic PPO with GAE, the GSPO loss and DAPO's overlong penalty together, checkpointed and resumed."""
import json
import os

import jax
import numpy as np

from areal_jax.system.job import RLJob
from areal_jax.testing.tiny import tiny_config


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_critic_gspo_and_overlong_penalty_job_resumes_with_its_value_head(tmp_path):
    c = tiny_config(str(tmp_path), eta=1, steps=2)
    c.train.loss = "gspo"
    c.train.critic = "value_head"
    c.train.gamma, c.train.lam = 1.0, 0.9
    c.rollout.overlong_buffer = 4  # max_new_tokens 8: completions past 4 tokens lose reward
    job = RLJob(c, log_fn=lambda *a, **k: None)
    try:
        job.run()
        head = jax.device_get(job.trainer.state.value_head)
        sampler_leaves = len(jax.tree.leaves(job.trainer.params))
    finally:
        job.close()
    assert float(np.abs(head["kernel"]).max()) > 0  # trained from its zero start
    rows = [r for r in _metrics(c.run_dir) if "train/value_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["train/value_loss"]) and np.isfinite(r["train/loss"]) for r in rows)
    # The resumed job restores the value head with the rest of the train state and runs one more step.
    c.total_steps = 3
    again = RLJob(c, log_fn=lambda *a, **k: None)
    try:
        assert again.trainer.version == 2
        np.testing.assert_array_equal(jax.device_get(again.trainer.state.value_head)["kernel"], head["kernel"])
        assert len(jax.tree.leaves(again.trainer.params)) == sampler_leaves  # the head stays out of the params
        again.run()
        assert again.trainer.version == 3
    finally:
        again.close()
