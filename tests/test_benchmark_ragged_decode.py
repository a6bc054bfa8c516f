"""benchmarks/ragged_decode.py at toy size (the kernel in the interpreter): both paths run over the same caches and
agree, the live share and the roofline follow from the drawn contexts, and the JSON line holds the figures."""
from __future__ import annotations

import importlib
import json
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_ragged_decode_benchmark_runs_and_its_paths_agree(monkeypatch, capsys):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    bench = importlib.import_module("ragged_decode")
    argv = ["--interpret", "--rows", "6", "--max-len", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--median", "20", "--cap", "40", "--prompt-len", "8", "16", "--repeats", "1",
            "--tilings", "2x16"]
    summary = bench.main(argv)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == json.loads(json.dumps(summary)) and line["benchmark"] == "ragged_decode" and line["interpreted"]
    assert line["max_abs_diff"] < 2e-2  # bfloat16 outputs
    assert line["xla_over_kernel"] == pytest.approx(line["xla_ms"] / line["kernel_ms"], rel=0.01)
    assert set(line["tilings_ms"]) == {"2x16"} and line["default_tiling"] == "1x64"  # 6 x 2 programs; one block
    assert line["auto"] is None  # the interpreter's times would say nothing of what a GPU takes
    args = bench.parse_args(argv)
    contexts = bench.steady_contexts(args, np.random.default_rng(args.seed)) + 1  # the same draw as the run's
    assert contexts.min() >= 9 and contexts.max() <= 16 + 40
    assert line["live_share"] == pytest.approx(contexts.sum() / (6 * 64), abs=1e-4)
    live_bytes = contexts.sum() * 2 * 2 * 16 * 2 * 2  # positions x (keys + values) x kv heads x dim x bf16 x layers
    assert line["roofline_ms"] == pytest.approx(live_bytes / (line["copy_bandwidth_gbs"] * 1e9) * 1e3, rel=0.01,
                                                abs=1e-4)


def test_the_benchmark_refuses_what_it_cannot_time(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    bench = importlib.import_module("ragged_decode")
    with pytest.raises(SystemExit):
        bench.parse_args(["--head-dim", "80"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--tilings", "2x24"])  # a block of no power of two
    with pytest.raises(SystemExit):
        bench.parse_args(["--max-len", "512"])  # a 128-token prompt and 1,024 new tokens do not fit
    with pytest.raises(SystemExit, match="--interpret"):
        bench.main(["--rows", "2", "--max-len", "64", "--cap", "32", "--prompt-len", "8", "16", "--median", "8"])
