"""The code task end to end at toy size: a random character-level model, synthetic programming tasks,
sandboxed test rewards through the reward pool, a few asynchronous GRPO steps and a code evaluation."""

import json
import os

import jax.numpy as jnp
import pytest

from areal_jax import config as config_lib
from areal_jax.data.code_synthetic import write_splits
from areal_jax.data.code_tokenizer import build_code_tokenizer
from areal_jax.evaluation.sets import flatten
from areal_jax.rewards.code import code_tests_reward
from areal_jax.system.job import RLJob
from areal_jax.testing.models import tiny_config as tiny_model_config
from areal_jax.testing.models import write_random_hf_checkpoint
from areal_jax.testing.tiny import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _code_config(tmp_path):
    tok = build_code_tokenizer()
    model_dir = str(tmp_path / "model")
    cfg = tiny_model_config("qwen2", vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, dtype=jnp.float32)
    write_random_hf_checkpoint(model_dir, cfg, seed=0)
    tok.save_pretrained(model_dir)
    paths = write_splits(str(tmp_path / "data"), 40, 4, seed=0)
    c = tiny_config(str(tmp_path), write=False, steps=2)
    c.model.path = model_dir
    c.data.task, c.data.question_field = "code", "text"
    c.data.train_path, c.data.test_path = paths["train"], paths["test"]
    c.data.max_prompt_len = 96
    c.rollout.max_new_tokens = 8
    c.rollout.max_len = 104
    c.train.micro_batch_tokens = 256
    c.reward.fn = "code"
    c.reward.code_case_timeout_s, c.reward.code_sample_timeout_s, c.reward.timeout_s = 2.0, 6.0, 20.0
    c.eval.n_test, c.eval.max_new_tokens, c.eval.at_start = 4, 8, False
    return c, paths


@pytest.mark.slow
def test_code_job_scores_sandboxed_tests_and_trains(tmp_path):
    c, paths = _code_config(tmp_path)
    # A greedy-only start evaluation (the before-training baseline) and a sampled end evaluation.
    c.eval.at_start, c.eval.start_samples, c.eval.samples = True, 0, 2
    with open(paths["train"]) as f:
        solutions = {json.loads(line)["text"]: json.loads(line)["code"] for line in f}
    lines = []
    job = RLJob(c, log_fn=lambda *a, **k: lines.append(" ".join(map(str, a))))
    submitted = []
    submit = job.reward_pool.submit

    def submit_some_correct(key, text, answer):
        # Even sample indices get the task's correct program (looked up by the prompt's statement), so
        # groups hold both outcomes: what a policy that sometimes solves the task would produce.
        if key[1] % 2 == 0:
            text = " " + solutions[job.controller._groups[key[0]]["example"].question]
        submitted.append((key, text, answer))
        submit(key, text, answer)

    job.reward_pool.submit = submit_some_correct
    try:
        summary = job.run()
    finally:
        job.close()
    with open(os.path.join(c.run_dir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["trained_version"] for r in rows] == [0, 0, 1, 1]
    for row in rows:  # the correct half scored 1, the random model's programs 0
        assert row["rewards"][0::2] == [1.0] * (row["n"] // 2 + row["n"] % 2)
        assert row["rewards"][1::2] == [0.0] * (row["n"] // 2)
    key, text, answer = submitted[0]
    assert code_tests_reward(text, answer) == (1.0 if key[1] % 2 == 0 else 0.0)
    assert json.loads(answer)["format"] == "code_tests/1"
    assert summary is not None and job.evaluations["end"]["n"] == 4
    start, end = job.evaluations["start"], job.evaluations["end"]
    assert start["n"] == 4 and "sampled_pass@1" not in start and "pass@2" not in start
    assert "sampled_pass@1" in end and "pass@2" in end
    for tag, k in (("start", 0), ("end", 2)):  # the per-problem records beside the run, rescored directly
        with open(os.path.join(c.run_dir, "evaluations", f"{tag}.jsonl")) as f:
            records = [json.loads(line) for line in f]
        assert [r["uid"] for r in records] == [e.uid for e in flatten(job.eval_sets)]
        for r, e in zip(records, flatten(job.eval_sets)):
            assert len(r["samples"]) == k
            assert [r["greedy_reward"], *r["sample_rewards"]] == [code_tests_reward(t, e.answer)
                                                                 for t in (r["greedy"], *r["samples"])]
        greedy = sum(r["greedy_reward"] >= 1.0 for r in records) / len(records)
        assert job.evaluations[tag]["greedy_pass@1"] == pytest.approx(greedy)
        total = len(records) * (1 + k)  # the evaluation's progress reached the log
        assert any(line.startswith(f"[eval {tag}] {total} / {total} sequences generated (100%)") for line in lines)


def test_code_task_config_mistakes_are_one_sentence_errors(tmp_path):
    c, _ = _code_config(tmp_path)
    c.reward.fn = "math"
    with pytest.raises(config_lib.ConfigError, match="--config.reward.fn=code"):
        config_lib.validate(c)
    c.reward.fn, c.data.task = "code", "math"
    with pytest.raises(config_lib.ConfigError, match="--config.data.task=code"):
        config_lib.validate(c)
    c.data.task, c.reward.timeout_s = "code", 5.0
    with pytest.raises(config_lib.ConfigError, match="must exceed --config.reward.code_sample_timeout_s"):
        config_lib.validate(c)


@pytest.mark.parametrize("name", ["code.py", "code_qwen.py", "code_repair.py"])
def test_shipped_code_configs_validate(name):
    config_lib.validate(config_lib.load_config_file(os.path.join(ROOT, "configs", name)), check_paths=False)
