"""A resumed run keeps its story: the start evaluation survives a resume into the final before / after
table, the ETA counts only steps run since the resume, and a run directory refuses a different model."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from areal_jax.config import ConfigError
from areal_jax.metrics import MetricsLogger
from areal_jax.programs.rl import format_summary
from areal_jax.system.job import RLJob
from areal_jax.testing.tiny import tiny_config
from areal_jax.testing.wandb_files import wandb_history

try:
    import wandb  # noqa: F401

    WANDB_PROJECT = "areal-jax-test"  # the first run also logs to W&B, offline
except ImportError:
    WANDB_PROJECT = ""


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _eta_seconds(line: str) -> float:
    eta = next(p for p in line.split(" | ") if p.startswith("ETA ")).split()[1]
    minutes, _, rest = eta.partition("m")
    return float(minutes) * 60 + float(rest.rstrip("s")) if rest else float(minutes.rstrip("s"))


@pytest.mark.parametrize("steps_seen", [3, 10])
def test_eta_after_resume_is_within_20_percent_of_the_real_remaining_time(tmp_path, steps_seen):
    """A first process ran 17 of 60 steps at 3 s each and died; the resume restarts from the step-10
    checkpoint, spends 90 s on start-up, compiles for 30 s inside its first step, and then runs at
    5 s +- 1 s per step (a busier machine). The progress line is printed after every step."""
    rng = np.random.default_rng(0)
    clock, total, resume_step = FakeClock(), 60, 10
    step_times = 5.0 + rng.uniform(-1, 1, size=total)
    logger = MetricsLogger(tmp_path, enabled=False, total_steps=total, start_step=resume_step, clock=clock)
    clock.now += 90.0  # checkpoint restore, compiles, the evaluation: not steps
    logger.mark_loop_start(resume_step)
    step = resume_step
    for i in range(steps_seen):
        clock.now += step_times[step] + (30.0 if i == 0 else 0.0)
        step += 1
        line = logger.progress_line(step, {})
    eta = _eta_seconds(line)
    real = float(step_times[step:].sum())
    assert abs(eta - real) <= 0.2 * real, (eta, real)


def _config(assets, run_dir, steps, **overrides):
    c = tiny_config(assets, run_dir=run_dir, steps=steps, write=False)
    c.eval.n_test = 6
    c.eval.samples = 2
    c.eval.at_end = False
    c.eval.max_new_tokens = 8
    for key, value in overrides.items():
        section, name = key.split("__")
        c[section][name] = value
    return c


def _checkpoint_meta(run_dir, step):
    with open(os.path.join(run_dir, "checkpoint_meta", str(step), "process_0.json")) as f:
        return json.load(f)


def _run(config):
    job = RLJob(config, log_fn=lambda *a, **k: None, machine={"matmul_peak_gflops": 12.5})
    try:
        return job.run()
    finally:
        job.close()


@pytest.mark.slow
def test_resume_keeps_the_start_evaluation_and_refuses_another_model(tmp_path):
    assets = str(tmp_path / "assets")
    tiny_config(assets)  # writes the tiny model and data
    run_dir = str(tmp_path / "run")
    def config(steps, **overrides):  # synchronous (eta = 0): the samples, and so the tasks retired, do not depend on
        c = _config(assets, run_dir, steps=steps, rollout__retire_unsolved=1, rollout__max_staleness=0, **overrides)
        c.seed = 1  # the machine's timing; seed 1 leaves 4 tasks unsolved by a whole group in the first 2 steps
        return c

    first = _run(config(2, log__wandb_project=WANDB_PROJECT, log__wandb_mode="offline"))
    start = first["evaluations"]["start"]
    assert start["n"] == 6 and 0.0 <= start["greedy_pass@1"] <= 1.0
    assert first["matmul_peak_gflops"] == 12.5 and 0 < first["eval_share"] < 1
    # Saves are written in the background (checkpoint.async_save): each write is a span on the timeline's
    # "checkpoint" lane, and the summary adds them up beside the time the trainer waited.
    with open(os.path.join(run_dir, "timeline.json")) as f:
        events = json.load(f)["traceEvents"]
    writes = [e for e in events if e.get("name") == "checkpoint_write"]
    assert 2 in {e["args"]["step"] for e in writes}
    assert first["checkpoint_write_s"] == pytest.approx(sum(e["dur"] for e in writes) / 1e6, abs=1e-5 * len(writes))
    assert 0 < first["checkpoint_blocked_s"] and "checkpoints: written in" in format_summary(first)

    if WANDB_PROJECT:  # the job's metrics reached W&B (offline files), the same numbers as metrics.jsonl
        run_id = open(os.path.join(run_dir, "wandb_run_id")).read().strip()
        (history,), _, _ = wandb_history(run_dir, run_id)
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        assert sorted(history) == sorted({r["step"] for r in rows}) == [0, 1, 2]  # eval/* at 0, the steps after
        assert [history[s]["reward"] for s in (1, 2)] == [r["reward"] for r in rows if "reward" in r]
    layouts = _checkpoint_meta(run_dir, 2)["layouts"]  # the trainer's ShapeBook, so a resume packs alike
    assert layouts["compiled"] and all(r > 0 and k > 0 for r, k in layouts["compiled"])

    retirement = _checkpoint_meta(run_dir, 2)["retirement"]  # the retired tasks, so a resume skips the same ones
    assert retirement["unsolved_after"] == 1 and retirement["resets"] == 0 and retirement["retired"]
    # The summary also counts groups that finished between the step-2 save and the controller's stop.
    assert first["retired_tasks"]["retired_unsolved"] >= len(retirement["retired"])

    resumed = _run(config(3))  # continues from step 2
    assert resumed["steps"] == 3
    assert retirement["retired"].items() <= _checkpoint_meta(run_dir, 3)["retirement"]["retired"].items()
    assert {tuple(s) for s in layouts["compiled"]} <= {tuple(s) for s in _checkpoint_meta(run_dir, 3)["layouts"]
                                                       ["compiled"]}
    assert resumed["evaluations"]["start"] == start  # measured by the first process, kept in the run's state
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["evaluations"]["start"]["greedy_pass@1"] == start["greedy_pass@1"]
    table = format_summary(resumed)
    before = next(line for line in table.splitlines() if line.startswith("test greedy pass@1")).split()[3]
    assert before == f"{100 * start['greedy_pass@1']:.1f}%"
    assert (f"tasks retired (rollout.retire_solved / retire_unsolved): 0 solved, "
            f"{resumed['retired_tasks']['retired_unsolved']} unsolved") in table

    # The same run directory with a model of another shape: one sentence naming the keys to change.
    from areal_jax.data.math_tokenizer import build_math_tokenizer
    from areal_jax.testing.models import tiny_config as tiny_model_config
    from areal_jax.testing.models import write_random_hf_checkpoint

    tok = build_math_tokenizer()
    other = str(tmp_path / "other_model")
    write_random_hf_checkpoint(other, tiny_model_config("qwen2", vocab_size=tok.vocab_size, hidden_size=32,
                                                        num_heads=2, num_kv_heads=1, bos_token_id=tok.bos_token_id,
                                                        eos_token_id=tok.eos_token_id))
    tok.save_pretrained(other)
    with pytest.raises(ConfigError) as e:
        RLJob(_config(assets, run_dir, steps=4, model__path=other), log_fn=lambda *a, **k: None)
    msg = str(e.value)
    assert "\n" not in msg and "--config.model.path" in msg and "--config.run_dir" in msg, msg
