"""A short soak (benchmarks/soak.py, 600 steps of the tiny run): nothing the run holds grows with its length.

Checked from the soak's own samples: threads and file descriptors return to their starting count once
the job is closed; the sampler queue, uncollected completions, in-flight groups, the trajectory buffer
and the reward backlog never exceed what the admission rule allows ((eta + 1) * B groups ahead of the
trainer); Python's heap, measured after a full garbage collection at every twentieth of the run, grows
by no more than 100 blocks per step over the second half (what grows on purpose: the summary's
per-step values, ~8 blocks per step), leaving out the one-off objects a jitted function adds when it
first meets a new shape (the estimator itself is checked on synthetic data below); resident memory
stays within a gross bound (it also moves with XLA's native allocations, e.g. a one-off compile when a
new shape appears, so it is reported by the benchmark rather than bounded tightly here).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from areal_jax.testing.processes import cpu_env
from areal_jax.testing.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.long  # (excluded from the default run: `-m long`)
def test_soak_600_steps_holds_bounded_state(tmp_path):
    steps, eta, batch_groups, group_size = 600, 1, 2, 2  # tiny_config's B and group size
    env = cpu_env(1)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--steps", str(steps), "--eta", str(eta),
         "--interval", "0.25", "--dir", str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["steps"] == steps and out["samples"] >= 10
    # Nothing left behind once the job is closed; while it runs, background writers may hold a file
    # open for a moment (a timeline spool, a metrics line), never more than a couple at once.
    assert out["threads"]["closed"] <= out["threads"]["start"], out["threads"]
    assert out["open_fds"]["closed"] <= out["open_fds"]["start"], out["open_fds"]
    assert out["threads"]["end"] <= out["threads"]["start"] + 2, out["threads"]
    assert out["open_fds"]["end"] <= out["open_fds"]["start"] + 2, out["open_fds"]
    bound = (eta + 1) * batch_groups
    assert out["admission_bound_groups"] == bound
    m = out["max"]
    assert m["ctl_in_flight"] <= bound and m["buffer_ready"] <= bound and m["buffer_generating"] <= bound
    for key in ("queue_samples", "uncollected", "reward_pending"):
        assert m[key] <= bound * group_size, (key, m)
    assert out["py_blocks_collected_steps_covered"] >= steps // 6, out["py_blocks_collected"]
    assert out["py_blocks_collected_per_100_steps_second_half"] < 10_000, (
        out["py_blocks_collected"], out["lowered_second_half"])
    assert out["rss_main_mb"]["end"] - out["rss_main_mb"]["start"] < 512, out["rss_main_mb"]
    assert out["staleness_max"] <= eta


def _soak_module():
    return load_script("benchmarks/soak.py")


def test_heap_growth_estimator_sees_a_leak_through_one_off_compiles():
    soak = _soak_module()
    rng = np.random.default_rng(0)

    def samples(leak_per_step: float) -> list:
        out, lowerings, level = [], 80, 850_000.0
        for step in range(300, 601, 15):
            if step in (390, 510):  # a new program each time: a one-off jump of 30,000 blocks
                lowerings += 1
                level += 30_000
            blocks = level + leak_per_step * step + rng.normal(0, 1500)
            out.append(soak.Sample(
                t=float(step), step=step, rss_main_mb=0.0, rss_workers_mb=0.0, py_blocks=int(blocks),
                lowerings=lowerings, py_blocks_collected=int(blocks), threads=1, open_fds=1, sampler_steps=0,
                busy_slot_steps=0.0, occupancy=0.0, queue_samples=0, running_slots=0, uncollected=0,
                ctl_in_flight=0, buffer_ready=0, buffer_generating=0, reward_pending=0))
        return out

    for leak in (0.0, 150.0):
        rate, covered = soak.heap_growth_between_lowerings(samples(leak))
        assert covered == 270  # 300..375, 390..495, 510..600: the two intervals with a jump are left out
        assert abs(rate - 100 * leak) < 3_000, (leak, rate)
    flat = samples(0.0)
    naive = np.polyfit([s.step for s in flat], [s.py_blocks_collected for s in flat], 1)[0] * 100
    assert naive > 10_000  # what a plain slope would have reported for a run without any leak
