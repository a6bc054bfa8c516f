"""benchmarks/sampling_head.py at a small size: both draws timed, greedy rows agreeing, log-probs the log-softmax's."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import sampling_head  # noqa: E402


def test_sampling_head_benchmark_times_both_draws_and_they_agree():
    report = sampling_head.main(["--rows", "16", "--vocab", "3000", "--block", "256", "--repeats", "2"])
    assert report["greedy_agree"] is True and report["max_logprob_gap"] < 1e-5
    assert report["one_level_ms"] > 0 and report["two_level_ms"] > 0 and report["speedup"] > 0
    assert (report["rows"], report["vocab"], report["block"]) == (16, 3000, 256)
