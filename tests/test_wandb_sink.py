"""Metrics to Weights & Biases (offline mode): what W&B wrote to its run file, read back record by record, equals
metrics.jsonl; a resumed logger continues the same W&B run; a bad log.wandb_* config fails before anything runs."""
from __future__ import annotations

import json
import os
import time

import pytest

from areal_jax.config import ConfigError
from areal_jax.metrics import LogConfig, MetricsLogger

wandb = pytest.importorskip("wandb")
from areal_jax.testing.wandb_files import wandb_history  # noqa: E402


def _logger(run_dir, start_step=0, lines=None):
    settings = LogConfig(wandb_project="areal-jax-test", wandb_mode="offline").wandb_settings(
        {"seed": 7}, (lines if lines is not None else []).append)
    return MetricsLogger(run_dir, enabled=True, total_steps=5, start_step=start_step, tensorboard=False,
                         wandb=settings)


def test_metrics_reach_wandb_as_in_metrics_jsonl_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path / "run")
    lines = []
    with _logger(run_dir, lines=lines) as m:
        for step in (1, 2, 3):
            m.log(step, {"reward": 0.25 * step, "train": {"loss": -1.5 / step}, "note": "text", "flag": True})
    run_id = open(os.path.join(run_dir, "wandb_run_id")).read().strip()
    assert lines == [f"Weights & Biases: run {run_id} in project 'areal-jax-test' (offline; files under {run_dir}/wandb)."]
    time.sleep(1.1)  # W&B names an offline run's directory by the second it starts (a real resume takes longer)
    with _logger(run_dir, start_step=2) as m:  # resumed from the step-2 checkpoint: step 3 again, then 4
        for step in (3, 4):
            m.log(step, {"reward": 1.0 + step, "train": {"loss": 0.5}})
    assert open(os.path.join(run_dir, "wandb_run_id")).read().strip() == run_id  # the same W&B run

    (first_run, resumed), runs = wandb_history(run_dir, run_id)
    assert {r.run_id for r in runs} == {run_id} and {r.project for r in runs} == {"areal-jax-test"}
    assert {r.display_name for r in runs} == {"run"}
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4]
    for history, logged in ((first_run, rows[:3]), (resumed, rows[3:])):  # numbers only: no string, no bool
        assert history == {r["step"]: {"reward": r["reward"], "train/loss": r["train/loss"]} for r in logged}
    assert resumed[4] == {"reward": 5.0, "train/loss": 0.5}


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
