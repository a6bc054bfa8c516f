"""Metrics to Weights & Biases (offline mode): what W&B wrote to its run file, read back record by record, equals
metrics.jsonl, plotted against the job's step; a resumed job's logger continues the same W&B run, and logs again the
steps it trains again without W&B's row counter going back; a bad log.wandb_* config fails before anything
runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from areal_jax.config import ConfigError
from areal_jax.metrics import LogConfig

wandb = pytest.importorskip("wandb")
from areal_jax.testing.wandb_files import wandb_history  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# One process of a job: its logger, as the job builds it (W&B offline), logging steps given as JSON.
LOGGER_PROCESS = """
import json, sys
from areal_jax.metrics import LogConfig, MetricsLogger
run_dir, steps = sys.argv[1], json.loads(sys.argv[2])
lines = []
settings = LogConfig(wandb_project="areal-jax-test", wandb_mode="offline").wandb_settings({"seed": 7}, lines.append)
with MetricsLogger(run_dir, enabled=True, total_steps=5, tensorboard=False, wandb=settings) as m:
    for step, metrics in steps:
        m.log(step, metrics)
print(json.dumps(lines))
"""


def _process(run_dir, steps):
    """A job process that logs `steps` and exits (W&B's files complete); the lines it printed."""
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", LOGGER_PROCESS, run_dir, json.dumps(steps)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_metrics_reach_wandb_as_in_metrics_jsonl_and_a_resume_continues_the_run(tmp_path):
    run_dir = str(tmp_path / "run")
    lines = _process(run_dir, [(step, {"reward": 0.25 * step, "train": {"loss": -1.5 / step}, "note": "text",
                                       "flag": True}) for step in (1, 2, 3)])
    run_id = open(os.path.join(run_dir, "wandb_run_id")).read().strip()
    assert lines == [f"Weights & Biases: run {run_id} in project 'areal-jax-test' (offline; files under {run_dir}/wandb)."]
    time.sleep(1.1)  # W&B names an offline run's directory by the second it starts (a real resume takes longer)
    # The resumed job (from the step-2 checkpoint): step 3 again, then 4, into the same W&B run.
    _process(run_dir, [(step, {"reward": 1.0 + step, "train": {"loss": 0.5}}) for step in (3, 4)])
    assert open(os.path.join(run_dir, "wandb_run_id")).read().strip() == run_id

    (first_run, resumed), runs, (first_file, resumed_file) = wandb_history(run_dir, run_id)
    assert {r.run_id for r in runs} == {run_id} and {r.project for r in runs} == {"areal-jax-test"}
    assert {r.display_name for r in runs} == {"run"}
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4]
    for history, logged in ((first_run, rows[:3]), (resumed, rows[3:])):  # numbers only: no string, no bool
        assert history == {r["step"]: {"reward": r["reward"], "train/loss": r["train/loss"]} for r in logged}
    assert resumed[4] == {"reward": 5.0, "train/loss": 0.5}
    # Every number is plotted against the job's step, and W&B's own row counter only grows: a row of a step lower
    # than one W&B has (step 3 again after the resume) is not one W&B drops.
    for info, steps in ((first_file, [1, 2, 3]), (resumed_file, [3, 4])):
        assert ("step", "") in info["metrics"] and ("*", "step") in info["metrics"]
        assert [s for _, s in info["rows"]] == steps
    # Offline, the resumed process's file continues the first file's row counter (they append into one run).
    assert [c for c, _ in first_file["rows"] + resumed_file["rows"]] == [0, 1, 2, 3, 4]


def test_bad_wandb_configs_fail_early(monkeypatch):
    with pytest.raises(ConfigError, match="wandb_project is empty"):
        LogConfig(wandb_name="x").check()
    with pytest.raises(ConfigError, match="choices|wandb_mode"):
        LogConfig(wandb_project="p", wandb_mode="cloud").check()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        LogConfig(wandb_project="p").check()
    assert LogConfig().wandb_settings({}, print) is None
