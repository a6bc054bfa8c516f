"""benchmarks/moe.py at toy size: every path runs, the JSON line holds the figures, and the expert paths and
transformers' own block (when torch is installed) compute the same layer output; the grouped-matmul kernel (Pallas
interpreter on CPU) when asked for; a path that fails leaves the others' figures."""
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


def test_forward_only_times_a_decode_steps_work(monkeypatch, capsys):
    """--forward-only: the same paths and outputs, and the active FLOPs of the forward alone (a third)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    moe = importlib.import_module("moe")
    line = moe.main(["--tokens", "32", "--repeats", "1", "--impls", "blocked,dense", "--forward-only"])
    assert line["forward_only"] and set(line["results"]) == {"blocked", "dense"}
    assert line["max_abs_diff"]["blocked"] < 1e-4
    assert moe.active_flops("small", 32, forward_only=True) * 3 == moe.active_flops("small", 32)
    assert line["results"]["dense"]["ms"] == pytest.approx(
        moe.active_flops("small", 32, forward_only=True) / line["results"]["dense"]["active_tflops"] / 1e9)


def test_the_kernel_path_runs_when_asked_and_a_failing_path_is_reported(monkeypatch, capsys):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    moe = importlib.import_module("moe")
    real = moe.time_jax

    def flaky(impl, *a):
        if impl == "ragged":
            raise MemoryError("out of memory")
        return real(impl, *a)

    monkeypatch.setattr(moe, "time_jax", flaky)
    line = moe.main(["--tokens", "16", "--repeats", "1", "--impls", "pallas,ragged,blocked"])
    assert set(line["results"]) == {"pallas", "blocked"} and line["failed"] == {"ragged": "MemoryError: out of memory"}
    assert line["max_abs_diff"]["blocked"] < 1e-4 and "pallas_over_blocked" in line["ratios"]


def test_lora_runs_time_the_factored_adapters_against_folded_ones(monkeypatch, capsys):
    """--lora-rank: each JAX path also with adapters on the experts, factored and folded; the two forms give the
    same layer output, and the figures include the compiled step's temporary memory."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    moe = importlib.import_module("moe")
    line = moe.main(["--tokens", "64", "--repeats", "1", "--impls", "blocked", "--lora-rank", "4"])
    assert set(line["results"]) == {"blocked", "lora-folded+blocked", "lora+blocked"} and line["lora_rank"] == 4
    assert line["max_abs_diff"]["lora+blocked"] < 1e-4
    assert {"lora+blocked_over_lora-folded+blocked", "lora+blocked_memory_over_lora-folded+blocked"} <= set(
        line["ratios"])
    assert all(r["temp_mib"] > 0 for r in line["results"].values())


def test_max_blocks_times_the_blocked_path_with_other_block_sizes(monkeypatch, capsys):
    """--max-blocks: blocked@N runs the same layer with blocks of at most N rows (the same output), and the model's own
    block size is back afterwards."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    moe = importlib.import_module("moe")
    from areal_jax.models import expert_paths as model_moe

    line = moe.main(["--tokens", "64", "--repeats", "1", "--impls", "blocked,dense", "--max-blocks", "8"])
    assert set(line["results"]) == {"blocked", "dense", "blocked@8"} and "blocked@8_over_blocked" in line["ratios"]
    assert line["max_abs_diff"]["blocked@8"] < 1e-4
    assert model_moe.MAX_EXPERT_BLOCK == 128 and model_moe.expert_block(64 * 4, 16) == 16
