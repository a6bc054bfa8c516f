"""benchmarks/moe.py at toy size: every path runs, the JSON line holds the figures, and the three expert paths and
transformers' own block (when torch is installed) compute the same layer output."""
from __future__ import annotations

import importlib
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_moe_benchmark_runs_and_its_paths_agree(monkeypatch, capsys):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    moe = importlib.import_module("moe")
    summary = moe.main(["--tokens", "48", "--repeats", "1"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == json.loads(json.dumps(summary)) and line["benchmark"] == "moe" and line["tokens"] == 48
    want = {"blocked", "ragged", "dense"}
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        want.add("torch")
    except ImportError:
        pass
    assert set(line["results"]) == want
    for figures in line["results"].values():
        assert figures["ms"] > 0 and figures["tokens_per_s"] > 0 and 0 < figures["share_of_peak"] < 1
    assert set(line["max_abs_diff"]) == want and max(line["max_abs_diff"].values()) < 1e-3
    assert "blocked_over_dense" in line["ratios"] and line["peak_gflops"] > 0
    assert line["results"]["dense"]["ms"] == pytest.approx(
        moe.active_flops("small", 48) / line["results"]["dense"]["active_tflops"] / 1e9)
