"""Bad input at the system level (through `areal_jax.main.run`): each mistake ends the run early with a
sentence that says what was wrong and how to fix it, or is skipped and counted while the run goes on.

The unit tests of each part cover the single functions (tests/test_data_readers.py, test_hf_io.py,
test_tokenizer.py, test_rewards_pool.py, test_trainer.py); these check the same mistakes made by a
user of the whole system: that they surface at all, surface before anything is compiled, and name
the config key, file, row or tensor to fix.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from areal_jax.testing.processes import cpu_env
from areal_jax.testing.tiny import tiny_config, write_tiny_assets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs each case through main.run in a fresh process whose JAX has compiled nothing yet, and records
# the JAX tracing / compilation events the case caused (jax.monitoring), its error and its duration.
NO_COMPILE_DRIVER = r'''
import json, sys, time


def main():
    assets, cases_path, out_path = sys.argv[1:4]
    import jax

    events = []
    jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: events.append(name))
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    from areal_jax.programs import rl as entry
    from areal_jax.testing.tiny import tiny_config

    with open(cases_path) as f:
        cases = json.load(f)
    results = {}
    for name, overrides in cases.items():
        c = tiny_config(assets, run_dir=f"{assets}/runs/{name}", steps=1)
        for dotted, value in overrides.items():
            *parents, leaf = dotted.split(".")
            node = c
            for p in parents:
                node = getattr(node, p)
            setattr(node, leaf, value)
        n0, t0 = len(events), time.perf_counter()
        error = None
        try:
            entry.run(c)
        except Exception as e:  # the point of each case
            error = e
        results[name] = {
            "type": type(error).__name__ if error is not None else None,
            "message": str(error) if error is not None else "",
            "seconds": time.perf_counter() - t0,
            "compiles": [e for e in events[n0:] if "backend_compile" in e],
            "traces": [e for e in events[n0:] if "/jax/core/compile/" in e],
        }
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
'''


def _lines(path, lines) -> str:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


GOOD_ROW = json.dumps({"question": "Tom has 5 apples. Tom gets 2 more. How many apples does Tom have now?",
                       "answer": "5+2=7. #### 7"})


def _tokenizer_without_eos(model_dir: str, out: str) -> str:
    os.makedirs(out)
    shutil.copy(os.path.join(model_dir, "tokenizer.json"), out)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    del cfg["eos_token"]
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def _edited_checkpoint(model_dir: str, out: str, edit) -> str:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, out)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


def test_mistakes_fail_with_a_sentence_before_anything_compiles(tmp_path):
    assets = str(tmp_path / "assets")
    paths = write_tiny_assets(assets)
    bad_jsonl = _lines(tmp_path / "bad.jsonl", [GOOD_ROW, GOOD_ROW, '{"question": "Tom has", "answer": '])
    bad_parquet = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"question": ["Tom has 5 apples. How many apples does Tom have now?", None],
                             "answer": ["#### 5", "#### 6"]}), bad_parquet)
    empty = _lines(tmp_path / "empty.jsonl", [""])
    long_only = _lines(tmp_path / "long.jsonl", [json.dumps(
        {"question": " ".join(["Tom has 5 apples."] * 30), "answer": "#### 5"})])
    no_eos = _tokenizer_without_eos(paths["model"], str(tmp_path / "tok_no_eos"))
    missing = _edited_checkpoint(paths["model"], str(tmp_path / "missing"),
                                 lambda t: t.pop("model.norm.weight"))
    misshaped = _edited_checkpoint(paths["model"], str(tmp_path / "misshaped"),
                                   lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1]}))
    cases = {
        "unknown_key": {"train.lrr": 1e-3},
        "mesh_too_many_devices": {"mesh.train_devices": 3, "mesh.rollout_devices": 3},
        "mesh_axis_does_not_divide": {"mesh.fsdp": 3},
        "minibatches_do_not_divide_batch": {"train.batch_groups": 3, "train.ppo_minibatches": 2},
        "micro_batch_below_max_len": {"train.micro_batch_tokens": 64},
        "group_larger_than_slots": {"rollout.group_size": 16},
        "group_of_one_learns_nothing": {"rollout.group_size": 1},
        "greedy_groups_learn_nothing": {"rollout.temperature": 0.0},
        "cosine_warmup_past_the_end": {"train.schedule": "cosine", "train.warmup_steps": 5},
        "timeline_cap_not_positive": {"log.timeline_max_events": 0},
        "malformed_jsonl_row": {"data.train_path": bad_jsonl},
        "malformed_parquet_row": {"data.train_path": bad_parquet},
        "empty_dataset": {"data.train_path": empty},
        "every_prompt_too_long": {"data.train_path": long_only},
        "tokenizer_without_eos": {"model.tokenizer_path": no_eos},
        "checkpoint_missing_tensor": {"model.path": missing, "model.tokenizer_path": paths["model"]},
        "checkpoint_misshaped_tensor": {"model.path": misshaped, "model.tokenizer_path": paths["model"]},
        "memory_does_not_fit_the_device": {"mesh.device_memory_gib": 1e-4},
    }
    if importlib.util.find_spec("wandb") is not None:  # online W&B without a login (HOME and the key cleared below)
        cases["wandb_without_login"] = {"log.wandb_project": "areal-jax-test"}
    cases_path, out_path, driver = tmp_path / "cases.json", tmp_path / "out.json", tmp_path / "driver.py"
    cases_path.write_text(json.dumps(cases))
    driver.write_text(NO_COMPILE_DRIVER)
    env = {k: v for k, v in cpu_env(4).items() if k != "WANDB_API_KEY"}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))
    proc = subprocess.run([sys.executable, str(driver), assets, str(cases_path), str(out_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out_path.read_text())

    expected = {  # case -> (error type, phrases the sentence must contain)
        "unknown_key": ("ConfigError", ["Unknown config key 'train.lrr'", "Did you mean '--config.train.lr'"]),
        "mesh_too_many_devices": ("ConfigError", ["exceeds the 4 local devices", "lower one of them"]),
        "mesh_axis_does_not_divide": ("ConfigError", ["fsdp*tensor=3 does not equal the 2 train devices",
                                                        "set fsdp=-1 to fill"]),
        "minibatches_do_not_divide_batch": ("ConfigError", ["--config.train.batch_groups=3 is not divisible by "
                                                            "--config.train.ppo_minibatches=2"]),
        "micro_batch_below_max_len": ("ConfigError", ["train.micro_batch_tokens=64 is smaller than "
                                                      "rollout.max_len=80", "must fit one micro-batch"]),
        "group_larger_than_slots": ("ConfigError", ["rollout.num_slots=8 is smaller than --config.rollout.group_size=16",
                                                    "Raise num_slots or lower group_size"]),
        "group_of_one_learns_nothing": ("ConfigError", ["--config.rollout.group_size=1", "every advantage is 0",
                                                        "--config.train.critic=value_head"]),
        "greedy_groups_learn_nothing": ("ConfigError", ["--config.rollout.temperature=0.0", "decodes greedily",
                                                        "every group advantage is 0"]),
        "cosine_warmup_past_the_end": ("ConfigError", ["must exceed --config.train.warmup_steps=5",
                                                      "--config.train.schedule=constant"]),
        "timeline_cap_not_positive": ("ConfigError", ["log.timeline_max_events=0 must be >= 1",
                                                      "log.timeline=False"]),
        "malformed_jsonl_row": ("ConfigError", [f"{bad_jsonl}, line 3: invalid JSON",
                                                "--config.data.on_bad_row=skip"]),
        "malformed_parquet_row": ("ConfigError", [f"{bad_parquet}, row index 1: field 'question' is null",
                                                  "--config.data.on_bad_row=skip"]),
        "empty_dataset": ("ConfigError", ["--config.data.train_path=", "has no usable rows"]),
        "every_prompt_too_long": ("ConfigError", ["longer than max_prompt_len=64", "raise max_prompt_len"]),
        "tokenizer_without_eos": ("ConfigError", ["no EOS token", "Set eos_token in tokenizer_config.json",
                                                  "--config.model.tokenizer_path"]),
        "checkpoint_missing_tensor": ("ConfigError", ["'model.norm.weight' is missing from the checkpoint",
                                                      "--config.model.path="]),
        "checkpoint_misshaped_tensor": ("ConfigError", ["'lm_head.weight'", "has shape (61, 64)",
                                                        "config.json implies (62, 64)", "--config.model.path="]),
        # 1e-4 GiB is about 107 kB; the tiny run's parts are listed, the largest first, with the key that shrinks it
        "memory_does_not_fit_the_device": ("ConfigError", ["This run does not fit its devices", "MiB per device of 0.0 GiB",
                                                           "The largest part is", "--config."]),
    }
    if "wandb_without_login" in cases:
        expected["wandb_without_login"] = ("ConfigError", ["Weights & Biases could not start the run", "wandb login",
                                                          "--config.log.wandb_mode=offline"])
    assert set(res) == set(expected)
    for name, (etype, phrases) in expected.items():
        r = res[name]
        assert r["type"] == etype, (name, r)
        for phrase in phrases:
            assert phrase in r["message"], (name, phrase, r["message"])
        assert r["compiles"] == [], (name, r)  # nothing was compiled
        assert r["seconds"] < 10.0, (name, r["seconds"])
        if not name.startswith(("checkpoint_", "memory_")):  # config, data and tokenizer: not even a trace
            assert r["traces"] == [], (name, r)


def test_cli_turns_an_impossible_mesh_into_exit_code_2_and_one_sentence(tmp_path):
    assets = str(tmp_path / "assets")
    write_tiny_assets(assets)
    proc = subprocess.run(
        [sys.executable, "-m", "areal_jax.main", f"--config={ROOT}/configs/tiny.py:{assets}",
         "--config.mesh.train_devices=3", "--config.mesh.rollout_devices=3"],
        env=cpu_env(4), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Config error: train_devices=3 + rollout_devices=3 exceeds the 4 local devices" in proc.stderr
    assert "Traceback" not in proc.stderr


def _run(config):
    from areal_jax.programs import rl as entry

    return entry.run(config)


def _samples(run_dir):
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_bad_rows_and_overlong_prompts_are_skipped_counted_and_never_trained(tmp_path):
    c = tiny_config(str(tmp_path / "assets"), steps=2)
    long_question = " ".join(["Tom has 5 apples."] * 30)  # > data.max_prompt_len = 64 tokens
    rows = [GOOD_ROW] * 3 + [
        "{not json",  # line 4
        json.dumps({"question": "Tom has 5 apples."}),  # line 5: no answer
        json.dumps({"question": long_question, "answer": "#### 5"}),  # line 6
        json.dumps({"question": 7, "answer": "#### 7"}),  # line 7: wrong type
        json.dumps({"question": long_question + " Tom", "answer": "#### 5"}),  # line 8
    ] + [GOOD_ROW] * 4
    c.data.train_path = _lines(tmp_path / "mixed.jsonl", rows)
    c.data.on_bad_row = "skip"
    summary = _run(c)
    assert summary["steps"] == 2
    assert summary["skipped_rows"] == {"malformed": 3, "too_long": 2}
    trained_lines = {int(r["uid"].split(":")[1]) for r in _samples(c.run_dir)}
    assert trained_lines and trained_lines.isdisjoint({4, 5, 6, 7, 8})


def odd_reward(completion: str, answer: str):
    """NaN, inf, a string or a real score depending on the completion (the run must go on)."""
    kind = sum(map(ord, completion)) % 4
    return [float("nan"), float("inf"), "seven", 1.0][kind]


def test_reward_returning_nan_inf_or_a_string_is_counted_and_scored_zero(tmp_path):
    # Raising and hanging reward functions at the system level: tests/test_system.py.
    c = tiny_config(str(tmp_path / "assets"), steps=3)
    c.reward.fn = "test_reliability_inputs:odd_reward"
    summary = _run(c)
    assert summary["steps"] == 3
    last = _metrics(c.run_dir)[-1]
    assert last["rollout/reward_nan"] > 0 and last["rollout/reward_ok"] > 0
    rewards = [x for r in _samples(c.run_dir) for x in r["rewards"]]
    assert set(rewards) <= {0.0, 1.0} and all(math.isfinite(x) for x in rewards)
    assert all(math.isfinite(m["train/loss"]) and m["train/skipped_updates"] == 0 for m in _metrics(c.run_dir))


def spread_reward(completion: str, answer: str) -> float:
    """Different scores for different completions, so advantages (and gradients) are non-zero."""
    return float(sum(map(ord, completion)) % 3) / 2


def test_non_finite_gradients_skip_that_update_and_the_run_goes_on(tmp_path, monkeypatch):
    import jax

    from areal_jax.trainer.trainer import Trainer

    seen = []
    update = Trainer.update

    def poisoned_update(self, trajectories):
        version = self.version
        if version == 1:  # a numerically broken batch: one behaviour log-prob is NaN
            trajectories[0].behav_logp = trajectories[0].behav_logp.copy()
            trajectories[0].behav_logp[0] = np.nan
        before = jax.device_get(self.state.params)
        metrics = update(self, trajectories)
        after = jax.device_get(self.state.params)
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
        seen.append((version, same, metrics["skipped_updates"], metrics["grad_norm"]))
        return metrics

    monkeypatch.setattr(Trainer, "update", poisoned_update)
    c = tiny_config(str(tmp_path / "assets"), steps=4)
    c.reward.fn = "test_reliability_inputs:spread_reward"
    c.rollout.temperature = 2.0  # varied completions, varied rewards
    summary = _run(c)
    assert summary["steps"] == 4 and [s[0] for s in seen] == [0, 1, 2, 3]
    assert seen[1][1] and seen[1][2] == 1.0  # skipped: params untouched, counted
    assert all(s[2] == 1.0 for s in seen[1:])  # the count is cumulative and stays at one
    assert seen[0][2] == 0.0
    changed = [not s[1] for i, s in enumerate(seen) if i != 1 and s[3] > 0]
    assert changed and all(changed)  # clean updates with a gradient are applied, before and after
    assert [m["train/skipped_updates"] for m in _metrics(c.run_dir)] == [0.0, 1.0, 1.0, 1.0]


def test_unknown_key_in_a_command_line_override_is_one_sentence():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "areal_jax.main", "--config=configs/math.py", "--config.train.lrr=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Unknown config key in the override '--config.train.lrr=1'" in proc.stderr
    assert "Did you mean '--config.train.lr'" in proc.stderr and "Traceback" not in proc.stderr
