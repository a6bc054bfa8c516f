"""benchmarks/goals_report.py against hand-made records of a GPU session: each goal's figure, threshold and verdict,
the last record of a run counting, and UNMEASURED where a run left no figures."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import goals_report  # noqa: E402


def sampler(steady, hf, device="NVIDIA H200", **kw):
    return {"benchmark": "sampler", "preset": "qwen2.5-0.5b", "dtype": "bfloat16", "num_slots": 256,
            "device_kind": device, "steady": {"tokens_per_s": steady}, "tokens_per_s": {"hf": hf}, **kw}


def loop(after0, after4, whole0=1000.0, whole4=1300.0, handoff=1.2):
    results = [{"eta": 0, "trained_tokens_per_s": whole0, "trained_tokens_per_s_after_first": after0},
               {"eta": 4, "trained_tokens_per_s": whole4, "trained_tokens_per_s_after_first": after4,
                "handoff": {"ratio_vs_raw_copy": handoff, "ratio_vs_raw_copy_source_bytes": 0.8,
                            "bytes_moved": 988e6}}]
    return {"benchmark": "loop", "preset": "qwen2.5-0.5b", "device": "NVIDIA H200", "results": results}


def run(tmp_path, records, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\nnot json\n")
    out = goals_report.main([str(path)])
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1]) == json.loads(json.dumps(out))
    return {r["goal"].split(":")[0].split(" (")[0]: r for r in out["goals"]}, printed


def test_every_goal_met(tmp_path, capsys):
    long = {"benchmark": "sampler", "preset": "qwen2.5-1.5b", "num_slots": 128, "max_new_tokens": 16384,
            "mean_slot_occupancy": 0.97, "generated_tokens": 400_000, "device_kind": "NVIDIA H200"}
    rows, printed = run(tmp_path, [sampler(50_000.0, 1_800.0), {"step": "x", "exit": 124, "json": None},
                                   sampler(65_000.0, 2_000.0), long, loop(100.0, 160.0)], capsys)
    assert rows["sampler 0.5B steady tokens/s"]["value"] == 65_000.0  # the last record of the run counts
    assert rows["sampler 0.5B steady / HF generate"]["value"] == pytest.approx(32.5)
    assert rows["1.5B 16k-token generations at once"]["value"] == 128
    assert rows["loop 0.5B"]["value"] == pytest.approx(1.6) and "whole run 1.30x" in rows["loop 0.5B"]["note"]
    assert rows["hand-off / raw copy of the same bytes"]["value"] == 1.2
    assert all(r["verdict"] == "PASS" for r in rows.values()), rows
    assert sum(line.startswith("PASS") for line in printed) == 5


def test_misses_and_missing_runs(tmp_path, capsys):
    rows, _ = run(tmp_path, [sampler(58_000.0, 2_000.0, device="NVIDIA H100 80GB HBM3"),
                             loop(100.0, 140.0, handoff=2.6)], capsys)
    assert rows["sampler 0.5B steady tokens/s"]["verdict"] == "FAIL"
    assert "H200" in rows["sampler 0.5B steady tokens/s"]["note"]  # an H100's figure is named as such
    assert rows["sampler 0.5B steady / HF generate"]["verdict"] == "FAIL"  # 29x
    assert rows["1.5B 16k-token generations at once"]["verdict"] == "UNMEASURED"
    assert rows["loop 0.5B"]["verdict"] == "FAIL" and rows["hand-off / raw copy of the same bytes"]["verdict"] == "FAIL"
    rows, _ = run(tmp_path, [{"step": "goal_sampler05", "exit": 124, "json": None}], capsys)
    assert {r["verdict"] for r in rows.values()} == {"UNMEASURED"}
