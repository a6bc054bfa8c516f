"""benchmarks/delta_rule.py at toy size: both paths run forward and backward, agree, and the JSON line holds the
figures (the speed-up is their times' ratio; the peak share follows from the counted FLOPs)."""
from __future__ import annotations

import importlib
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_delta_rule_benchmark_runs_and_its_paths_agree(monkeypatch, capsys):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    bench = importlib.import_module("delta_rule")
    summary = bench.main(["--tokens", "100", "--heads", "2", "--key-dim", "8", "--value-dim", "6", "--chunk", "32",
                          "--repeats", "1"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == json.loads(json.dumps(summary)) and line["benchmark"] == "delta_rule" and line["tokens"] == 100
    assert line["max_output_difference"] < 1e-4
    assert line["speedup"] == pytest.approx(line["token_scan_median_s"] / line["chunked_median_s"], rel=0.01)
    flops = bench.chunked_flops(2, 100, 2, 8, 6, 32)
    assert line["chunked_peak_fraction"] == pytest.approx(flops / line["chunked_median_s"] / 1e9 / line["peak_gflops"],
                                                          rel=0.01, abs=1e-4)
    assert line["chunked_tokens_per_s"] > 0 and line["token_scan_tokens_per_s"] > 0
