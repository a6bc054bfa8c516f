"""A short soak (benchmarks/soak.py, 300 steps of the tiny run): nothing the run holds grows with its length.

Checked from the soak's own samples: threads and file descriptors return to their starting count;
the sampler queue, uncollected completions, in-flight groups, the trajectory buffer and the reward
backlog never exceed what the admission rule allows ((eta + 1) * B groups ahead of the trainer);
Python's heap grows by no more than a few blocks per step over the second half (the timeline buffer,
itself bounded, and the summary's per-step values); resident memory stays within a gross bound (it
also moves with XLA's native allocations, e.g. a one-off compile when a new shape appears, so it is
reported by the benchmark rather than bounded tightly here).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_soak_300_steps_holds_bounded_state(tmp_path):
    steps, eta, batch_groups, group_size = 300, 1, 2, 2  # tiny_config's B and group size
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--steps", str(steps), "--eta", str(eta),
         "--interval", "0.25", "--dir", str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["steps"] == steps and out["samples"] >= 10
    assert out["threads"]["end"] <= out["threads"]["start"]
    assert out["open_fds"]["end"] <= out["open_fds"]["start"]
    bound = (eta + 1) * batch_groups
    assert out["admission_bound_groups"] == bound
    m = out["max"]
    assert m["ctl_in_flight"] <= bound and m["buffer_ready"] <= bound and m["buffer_generating"] <= bound
    for key in ("queue_samples", "uncollected", "reward_pending"):
        assert m[key] <= bound * group_size, (key, m)
    assert out["py_blocks_per_100_steps_second_half"] < 10_000, out["py_blocks"]
    assert out["rss_main_mb"]["end"] - out["rss_main_mb"]["start"] < 512, out["rss_main_mb"]
    assert out["staleness_max"] <= eta
