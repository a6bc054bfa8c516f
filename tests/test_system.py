"""End-to-end runs of the asynchronous system on a tiny random model (CPU, a few steps each).

What is checked comes from the run's own records (samples.jsonl: per-group admission / token versions
and the trainer version that trained it), not from the code paths that produce them.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from areal_jax.system.job import RLJob
from areal_jax.testing.processes import cpu_env
from areal_jax.testing.tiny import tiny_config, write_tiny_assets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _samples(run_dir):
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_job(config, on_publish=None):
    job = RLJob(config, log_fn=lambda *a, **k: None)
    if on_publish is not None:
        update = job.sampler.update_params  # the job hands each published version to the sampler
        job.sampler.update_params = lambda params, version: (on_publish(job, params, version), update(params, version))
    try:
        return job, job.run()
    finally:
        job.close()


@pytest.mark.slow
@pytest.mark.parametrize("eta,colocated", [(0, False), (1, True), (4, False)])
def test_staleness_bound_and_exactly_once(tmp_path, eta, colocated):
    steps, batch_groups, group_size = 4, 2, 2
    c = tiny_config(str(tmp_path), eta=eta, steps=steps)
    if colocated:  # both slices on every device
        c.mesh.colocated = True
    else:  # split slices: publish crosses devices
        c.mesh.train_devices, c.mesh.rollout_devices = 1, 1
    checked = []

    def on_publish(job, params, version):
        # The rollout copy equals the trainer's params at publish time, and lives on the rollout slice.
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(job.trainer.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding.device_set == set(job.meshes.rollout_mesh.devices.flat)
            if colocated:  # the copy the update wrote in the sampler's layout, handed over: never the state's buffers
                assert not {s.data.unsafe_buffer_pointer() for s in a.addressable_shards} & {
                    s.data.unsafe_buffer_pointer() for s in b.addressable_shards}
            else:
                assert a.sharding.device_set.isdisjoint(b.sharding.device_set)
        assert job.channel.last_copied is not colocated
        checked.append(version)

    job, summary = _run_job(c, on_publish)
    assert checked == list(range(1, steps + 1))
    # After the last publish the sampler decodes with exactly the trainer's params.
    deadline = time.time() + 10
    while job.sampler.current_version != steps and time.time() < deadline:
        time.sleep(0.05)
    for a, b in zip(jax.tree.leaves(job.sampler.versioned_params()[1]), jax.tree.leaves(job.trainer.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    rows = _samples(c.run_dir)
    assert summary["steps"] == steps
    # The memory plan, from shapes, is what the trainer and the sampler hold (split slices: the larger side);
    # a CPU reports no limit, so remat "auto" is "none".
    plan = summary["memory_plan_bytes"]
    assert summary["remat"] == "none" and summary["device_memory_bytes"] is None
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(job.trainer.state.params))  # a device's
    assert plan["params"] == held and plan["gradients"] == held and plan["optimizer"] >= 2 * held
    assert len(rows) == steps * batch_groups
    assert [r["gid"] for r in rows] == list(range(steps * batch_groups))  # each group once, in order
    assert len({r["uid"] for r in rows}) == len(rows)
    assert all(r["n"] == group_size and len(r["rewards"]) == group_size for r in rows)
    for r in rows:
        assert r["trained_version"] - r["min_token_version"] <= eta, r
        assert r["admit_version"] <= r["min_token_version"] <= r["max_token_version"] <= r["trained_version"]
    assert [r["trained_version"] for r in rows] == [i // batch_groups for i in range(len(rows))]
    if eta == 0:
        assert all(r["min_token_version"] == r["trained_version"] for r in rows)


def flaky_reward(completion: str, answer: str) -> float:
    """Raises for some samples, hangs for others, else scores 1 (for the fault test below)."""
    h = sum(map(ord, completion)) % 4
    if h == 0:
        raise ValueError("reward function failure")
    if h == 1:
        time.sleep(30)
    return 1.0


@pytest.mark.slow
def test_reward_that_raises_or_hangs_costs_only_its_samples(tmp_path):
    c = tiny_config(str(tmp_path), eta=1, steps=3)
    c.reward.fn = "test_system:flaky_reward"
    c.reward.timeout_s = 0.5
    c.reward.num_workers = 2
    job, summary = _run_job(c)
    counters = job.controller.counters
    assert summary["steps"] == 3
    assert counters["reward_error"] > 0 and counters["reward_timeout"] > 0 and counters["reward_ok"] > 0
    rows = _samples(c.run_dir)
    assert len(rows) == 6
    rewards = [x for r in rows for x in r["rewards"]]
    assert set(rewards) <= {0.0, 1.0} and 0.0 in rewards and 1.0 in rewards


def _main_cmd(assets, run_dir, steps):
    return [sys.executable, "-m", "areal_jax.main", f"--config={ROOT}/configs/tiny.py:{assets}",
            f"--config.run_dir={run_dir}", f"--config.total_steps={steps}", "--config.checkpoint.every_steps=2"]


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_continues_with_same_data_order(tmp_path):
    assets, steps = str(tmp_path / "assets"), 6
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    write_tiny_assets(assets)
    subprocess.run(_main_cmd(assets, ref_dir, steps), env=cpu_env(1), check=True, cwd=ROOT, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = subprocess.Popen(_main_cmd(assets, run_dir, steps), env=cpu_env(1), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt2 = os.path.join(run_dir, "checkpoints", "2")
    deadline = time.time() + 300
    while not os.path.isdir(ckpt2) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert os.path.isdir(ckpt2), "no checkpoint appeared"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(_main_cmd(assets, run_dir, steps), env=cpu_env(1), cwd=ROOT, timeout=600,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from checkpoint step" in resumed.stdout + resumed.stderr
    # Libraries' INFO records (orbax: ~10 per checkpoint) stay off the console without --verbosity.
    assert not re.search(r"^I\d{4} ", resumed.stdout + resumed.stderr, re.M), resumed.stderr[-2000:]
    ref, got = _samples(ref_dir), _samples(run_dir)
    assert [r["uid"] for r in got] == [r["uid"] for r in ref]  # same data order, nothing twice or lost
    assert [r["trained_version"] for r in got] == list(np.repeat(np.arange(steps), 2))
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["steps"] == steps


@pytest.mark.slow
def test_kl_penalty_to_the_starting_policy(tmp_path):
    c = tiny_config(str(tmp_path), eta=1, steps=3)
    c.train.kl_coef = 0.1
    _run_job(c)
    with open(os.path.join(c.run_dir, "metrics.jsonl")) as f:
        kl = [json.loads(line)["train/kl"] for line in f if "train/kl" in line]
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # the first update starts at the reference params
    assert max(kl[1:]) > 0  # later updates have moved away from them
