"""benchmarks/retirement.py: its JSON holds both variants, and the retiring run's own sample log shows no group of a
retired task admitted after the update that trained the group retiring it (eta = 0: every group of a batch is
scored before the next batch is admitted)."""
import json
import os

import pytest

from areal_jax.programs.report import read_samples, task_outcomes
from areal_jax.system.retire import task_key
from areal_jax.testing.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    return load_script("benchmarks/retirement.py")


@pytest.mark.long  # (excluded from the default run: `-m long`)
def test_retirement_benchmark_and_the_sample_log_agree(tmp_path, capsys):
    bench = _load()
    # 16 tasks, 16 groups an update: each update is about one pass.
    report = bench.main(["--tasks", "16", "--steps", "3", "--solved", "0", "--unsolved", "1", "--n-test", "0",
                         "--out", str(tmp_path), "--extra", "rollout.max_staleness=0", "--compile-cache", "shared"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(report))
    none, retire = report["runs"]["none"][0], report["runs"]["retire"][0]
    assert report["tasks"] == 16 and report["passes"] == 3.0
    assert none["retired_unsolved"] == none["skipped_prompts"] == 0
    assert retire["retired_unsolved"] > 0 and retire["skipped_prompts"] > 0 and retire["retirement_resets"] == 0
    assert none["steps"] == retire["steps"] == 3

    with open(os.path.join(tmp_path, "retire_seed0", "checkpoint_meta", "3", "process_0.json")) as f:
        retired = json.load(f)["retirement"]["retired"]
    assert len(retired) == retire["retired_unsolved"] and set(retired.values()) == {"unsolved"}
    rows = sorted(read_samples(os.path.join(tmp_path, "retire_seed0")), key=lambda r: r["trained_version"])
    for task in retired:  # retired by its first group that no sample solved; nothing of it admitted afterwards
        groups = [r for r in rows if task_key(r["uid"]) == task]
        verdict = next(r for r in groups if max(r["rewards"]) < 1)
        assert all(r["admit_version"] <= verdict["trained_version"] for r in groups), groups
    table, _ = task_outcomes(rows, min_groups=1)
    assert any(t["groups"] > 1 and t["task"] not in retired for t in table)  # the others came back
