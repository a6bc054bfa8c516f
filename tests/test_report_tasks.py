"""The report's task table (tasks.csv) from a run's samples*.jsonl, and the per-step share of groups whose samples
all scored alike, against counts worked by hand."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from areal_jax.programs import report
from areal_jax.system.runner import batch_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _line(uid, rewards, version):
    return json.dumps({"uid": uid, "gid": 0, "admit_version": version, "min_token_version": version,
                       "max_token_version": version, "trained_version": version, "n": len(rewards),
                       "rewards": rewards}) + "\n"


@pytest.fixture
def run_dir(tmp_path):
    """Two processes' sample logs, a torn last line, four tasks (two of them in both epochs).

    t.jsonl:1  epochs 0, 1: [0, 0, 0, 0], [0, 0, 0, 0]      never solved, 2 groups, 8 samples
    t.jsonl:2  epochs 0, 1: [1, 0, 1, 0], [1, 1, 1, 1]      6 of 8 solved, mean 0.75
    t.jsonl:3  epoch 0:     [0, 0, 0, 0]                    never solved in 1 group only
    t.jsonl:4  epochs 0, 1: [1, 1, 1, 1], [1.0, 1, 1, 1]    solved by every sample
    Groups whose rewards are all equal: 6 of 7.
    """
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    (d / "samples.process_0.jsonl").write_text(
        _line("t.jsonl:1:0", [0, 0, 0, 0], 1) + _line("t.jsonl:2:0", [1, 0, 1, 0], 1) + _line("t.jsonl:3:0", [0] * 4, 2)
        + _line("t.jsonl:4:1", [1, 1, 1, 1], 5) + '{"uid": "t.jsonl:9:0", "rew')
    (d / "samples.process_1.jsonl").write_text(
        _line("t.jsonl:4:0", [1, 1, 1, 1], 2) + _line("t.jsonl:1:1", [0, 0, 0, 0], 4)
        + _line("t.jsonl:2:1", [1, 1, 1, 1], 6))
    return str(d)


def test_task_table_counts_worked_by_hand(run_dir):
    table, summary = report.task_outcomes(report.read_samples(run_dir))
    assert [t["task"] for t in table] == ["t.jsonl:1", "t.jsonl:3", "t.jsonl:2", "t.jsonl:4"]
    by = {t["task"]: t for t in table}
    assert {k: by["t.jsonl:1"][k] for k in ("groups", "samples", "solved", "first_trained_version",
                                            "last_trained_version")} == {
        "groups": 2, "samples": 8, "solved": 0, "first_trained_version": 1, "last_trained_version": 4}
    assert (by["t.jsonl:2"]["solved"], by["t.jsonl:2"]["solve_rate"], by["t.jsonl:2"]["mean_reward"]) == (6, 0.75, 0.75)
    assert (by["t.jsonl:4"]["groups"], by["t.jsonl:4"]["solve_rate"]) == (2, 1.0)
    assert summary == {"tasks": 4, "groups": 7, "min_groups": 2, "tasks_in_min_groups": 3, "never_solved": 1,
                       "never_solved_sample_share": 8 / 28, "always_solved": 1, "always_solved_sample_share": 8 / 28,
                       "uniform_group_share": 6 / 7}
    _, one = report.task_outcomes(report.read_samples(run_dir), min_groups=1)
    assert (one["never_solved"], one["never_solved_sample_share"]) == (2, 12 / 28)


def test_the_command_writes_tasks_csv_and_prints_the_summary(run_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "areal_jax.programs.report", run_dir, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert str(out / "tasks.csv") in proc.stdout.splitlines()
    assert "never solved in 2 groups or more: 1 tasks, 28.6% of the samples" in proc.stdout
    assert "groups whose samples all scored alike (no group advantage): 85.7%" in proc.stdout
    with open(out / "tasks.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(report.TASK_COLUMNS)
    assert [(r["task"], r["groups"], r["solved"], r["solve_rate"]) for r in rows] == [
        ("t.jsonl:1", "2", "0", "0.0"), ("t.jsonl:3", "1", "0", "0.0"), ("t.jsonl:2", "2", "6", "0.75"),
        ("t.jsonl:4", "2", "8", "1.0")]
    bad = subprocess.run([sys.executable, "-m", "areal_jax.programs.report", run_dir, "--min-groups", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert bad.returncode == 2 and "--min-groups=0 must be at least 1" in bad.stderr


def test_a_run_without_sample_logs_has_no_task_table(tmp_path):
    assert report.write_task_table(str(tmp_path)) is None


def test_batch_summary_counts_groups_whose_samples_all_scored_alike():
    class G:  # the fields batch_summary reads
        def __init__(self, rewards):
            self.rewards = np.asarray(rewards, np.float32)
            self.completions = [type("C", (), {"tokens": [1, 2], "versions": np.array([3]), "finish_reason": "stop"})()
                                for _ in rewards]

    summary = batch_summary([G([0, 0, 0]), G([1, 1, 1]), G([0, 1, 0]), G([0.5, 0.5, 0.5])], trainer_version=3)
    assert summary["uniform_group_fraction"] == 0.75


def test_tasks_csv_marks_the_tasks_retired_at_the_latest_checkpoint(run_dir, tmp_path):
    def meta(step, process, retired):
        path = os.path.join(run_dir, "checkpoint_meta", str(step), f"process_{process}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"version": step, "retirement": {"retired": retired, "streaks": {}, "resets": 0}}, f)

    meta(2, 0, {"t.jsonl:2": "solved"})  # an older checkpoint: not read
    meta(4, 0, {"t.jsonl:4": "solved"})
    meta(4, 1, {"t.jsonl:1": "unsolved"})
    assert report.read_retired(run_dir) == {"t.jsonl:4": "solved", "t.jsonl:1": "unsolved"}
    path, summary = report.write_task_table(run_dir, str(tmp_path / "out"))
    with open(path) as f:
        assert {r["task"]: r["retired"] for r in csv.DictReader(f)} == {
            "t.jsonl:1": "unsolved", "t.jsonl:3": "", "t.jsonl:2": "", "t.jsonl:4": "solved"}
    assert report.task_lines(summary)[-1].endswith(": 1 solved, 1 unsolved")
    assert report.read_retired(str(tmp_path)) == {}  # no checkpoint_meta: nothing retired
