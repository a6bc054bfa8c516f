"""benchmarks/sampler.py at toy size: every engine runs, the JSON line carries the figures the issue asks for."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sampler_benchmark_reports_steady_state_and_roofline():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "sampler.py"), "--hidden", "32", "--layers", "1",
           "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--vocab", "128", "--num-slots", "4",
           "--num-prompts", "10", "--max-new-tokens", "12", "--median-new-tokens", "4", "--prompt-len", "2", "6",
           "--decode-steps", "3", "--steady", "--warmup-seconds", "0.5", "--steady-seconds", "2", "--skip-hf"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["preset"] == "tiny" and out["dtype"] == "float32" and out["decode_steps"] == 3
    assert out["standby_rows"] == 2  # the job's default: num_slots / 2 with the dense cache and k > 1
    assert out["tokens_per_s"]["continuous"] > 0 and out["tokens_per_s"]["static"] > 0
    assert out["tokens_per_s"]["hf"] is None and out["ratio_a_b"] > 0
    steady = out["steady"]
    for key in ("tokens_per_s", "mean_slot_occupancy", "step_ms", "update_latency_ms", "update_latency_max_ms",
                "idle_slot_steps_per_finished"):
        assert steady[key] is not None and steady[key] >= 0, key
    assert 0 < steady["mean_slot_occupancy"] <= 1 and steady["updates"] >= 1
    bare = steady["bare"]  # the same dispatch alone: every slot live, every step inside the 18-position cache
    assert bare["rows"] == 4 and bare["decode_steps"] == 3 and bare["step_ms"] > 0 and bare["roofline_ms"] > 0
    assert abs(bare["steady_over_bare"] - steady["step_ms"] / bare["step_ms"]) < 1e-2
    assert 1 <= bare["context_mean"] <= bare["context_max"] and bare["context_max"] + (bare["dispatches"] + 2) * 3 <= 6 + 12
    roof = out["roofline"]
    # weights: the params' bytes; one step reads them plus the live KV, so bytes_per_step exceeds them.
    assert roof["bytes_per_step"] > roof["weight_bytes"] > 0
    assert roof["weight_bytes"] == 4 * out["params"]  # float32 params
    want = roof["live_rows"] * out["copy_bandwidth_gbs"] * 1e9 / roof["bytes_per_step"]
    assert abs(roof["tokens_per_s"] - want) <= 0.01 * want + 1  # rows / (bytes per step / bandwidth)
    assert 0 < roof["share"] and out["copy_bandwidth_gbs"] > 0


def test_live_contexts_follow_the_steady_state_worked_by_hand(monkeypatch):
    # A request of prompt P and length L holds a slot for L steps at contexts P, P + 1, ..., P + L - 1. With a
    # 5-token prompt generating 1 token and a 3-token prompt generating 3, a live row is the first a quarter of
    # the time (context 5) and the second three quarters (3, 4 or 5 alike): P(3) = P(4) = 1/4, P(5) = 1/2.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import numpy as np
    from decode_roofline import live_contexts

    got = live_contexts([[7] * 5, [7] * 3], [1, 3], 40_000, np.random.default_rng(0))
    share = {c: float(np.mean(got == c)) for c in (3, 4, 5)}
    assert set(np.unique(got)) == {3, 4, 5}
    assert abs(share[3] - 0.25) < 0.01 and abs(share[4] - 0.25) < 0.01 and abs(share[5] - 0.5) < 0.01
