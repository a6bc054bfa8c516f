"""Math and programming tasks in one run (data.train_tasks / data.test_tasks, reward.fn=mixed): which reward an
answer gets, the config's errors, and a job whose every reward, in training and in each evaluation set, equals
the right task's reward called directly."""
import json
import os

import jax.numpy as jnp
import pytest

from areal_jax import config as config_lib
from areal_jax.config import ConfigError
from areal_jax.data.code_synthetic import write_splits as write_code_splits
from areal_jax.data.code_tokenizer import build_code_tokenizer
from areal_jax.data.synthetic_math import write_splits as write_math_splits
from areal_jax.evaluation.sets import flatten
from areal_jax.rewards.code import code_tests_reward
from areal_jax.rewards.code_tests import TestSpec, encode_tests
from areal_jax.rewards.math import math_reward
from areal_jax.rewards.mixed import is_code_answer, mixed_reward
from areal_jax.system.job import RLJob
from areal_jax.testing.models import tiny_config as tiny_model_config
from areal_jax.testing.models import write_random_hf_checkpoint
from areal_jax.testing.tiny import tiny_config

TESTS = encode_tests(TestSpec(calls=(("f(2)", 4), ("f(5)", 10))))


def test_an_answer_is_scored_by_its_tasks_reward():
    assert is_code_answer(TESTS) and not is_code_answer("12") and not is_code_answer("{1, 2}")
    assert not is_code_answer('{"format": "other", "x": "code_tests/1"}')
    code = lambda text, answer: code_tests_reward(text, answer, case_timeout_s=4.0, sample_timeout_s=8.0)  # noqa: E731
    assert mixed_reward("```python\ndef f(x):\n    return 2 * x\n```", TESTS, code_reward=code) == 1.0
    assert mixed_reward("```python\ndef f(x):\n    return x\n```", TESTS, code_reward=code) == 0.0
    assert mixed_reward("so the answer is \\boxed{12}", "12", code_reward=code) == 1.0  # the math reward
    assert mixed_reward("12", "12", code_reward=lambda *a: pytest.fail("a math answer reached the code reward")) == 1.0


def _config(tmp_path):
    tok = build_code_tokenizer()  # characters: it writes both the math questions and the programs
    model_dir = str(tmp_path / "model")
    cfg = tiny_model_config("qwen2", vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, dtype=jnp.float32)
    write_random_hf_checkpoint(model_dir, cfg, seed=0)
    tok.save_pretrained(model_dir)
    math = write_math_splits(str(tmp_path / "math"), 12, 3, seed=0)
    code = write_code_splits(str(tmp_path / "code"), 12, 3, seed=0)
    c = tiny_config(str(tmp_path), write=False, eta=1, steps=2)
    c.model.path = model_dir
    c.data.train_path, c.data.train_tasks = f"math={math['train']},code={code['train']}", "math,code"
    c.data.train_weights = "1,1"
    c.data.test_path, c.data.test_tasks = f"math={math['test']},code={code['test']}", "math,code"
    c.data.max_prompt_len = 200  # characters: every math question fits
    c.rollout.max_new_tokens, c.rollout.max_len = 8, 208
    c.train.micro_batch_tokens = 256
    c.reward.fn = "mixed"
    c.reward.code_case_timeout_s, c.reward.code_sample_timeout_s, c.reward.timeout_s = 2.0, 6.0, 20.0
    c.eval.n_test, c.eval.max_new_tokens, c.eval.at_start, c.eval.samples = 3, 8, False, 1
    return c, math, code


def test_mixed_task_configs_fail_with_the_key_to_change(tmp_path):
    c, _, _ = _config(tmp_path)
    config_lib.validate(c)
    for fn in ("math", "code"):
        c.reward.fn = fn
        with pytest.raises(ConfigError, match="mix math and programming tasks.*--config.reward.fn=mixed"):
            config_lib.validate(c)
    c.reward.fn = "mixed"
    c.data.train_tasks = "math"
    with pytest.raises(ConfigError, match=r"data.train_tasks='math' gives 1 task\(s\) for 2 file\(s\)"):
        config_lib.validate(c)
    c.data.train_tasks = "math,prose"
    with pytest.raises(ConfigError, match="'prose' is not a task; each is one of math, code"):
        config_lib.validate(c)


@pytest.mark.slow
def test_a_job_scores_each_training_and_evaluation_row_by_its_task(tmp_path):
    c, math, code = _config(tmp_path)
    programs = {json.loads(line)["text"]: json.loads(line)["code"] for line in open(code["train"])}
    job = RLJob(config_lib.validate(c), log_fn=lambda *a, **k: None)
    submitted = {}
    submit = job.reward_pool.submit

    def submit_half_correct(key, text, answer):  # even samples get the right program, or the right number
        if key[1] % 2 == 0:
            example = job.controller._groups[key[0]]["example"]
            text = (f"```python\n{programs[example.question]}\n```"
                    if is_code_answer(answer) else f"The answer is \\boxed{{{answer}}}")
        submitted[key] = (text, answer)
        submit(key, text, answer)

    job.reward_pool.submit = submit_half_correct
    try:
        summary = job.run()
    finally:
        job.close()
    samples = [json.loads(line) for line in open(os.path.join(c.run_dir, "samples.jsonl"))]
    assert {s["uid"].split(":")[0] for s in samples} == {"math", "code"}
    code_reward = config_lib.validate(c).reward.scorer().keywords["code_reward"]
    for s in samples:
        assert s["rewards"][0::2] == [1.0] * len(s["rewards"][0::2])  # both tasks' right answers score 1
        for i, r in enumerate(s["rewards"]):  # and every reward is its task's, called directly
            text, answer = submitted[(s["gid"], i)]
            want = code_reward(text, answer) if s["uid"].startswith("code:") else math_reward(text, answer)
            assert r == want and is_code_answer(answer) == s["uid"].startswith("code:")
    records = [json.loads(line) for line in open(os.path.join(c.run_dir, "evaluations", "end.jsonl"))]
    assert [r["set"] for r in records] == ["math"] * 3 + ["code"] * 3
    examples = flatten(job.eval_sets)
    for r, e in zip(records, examples):  # each set read as its task, its completions scored by its task's reward
        assert r["uid"] == e.uid and is_code_answer(e.answer) == (r["set"] == "code")
        want = code_reward if r["set"] == "code" else math_reward
        assert [r["greedy_reward"], *r["sample_rewards"]] == [want(t, e.answer) for t in (r["greedy"], *r["samples"])]
    assert set(summary["evaluations"]["end"]["sets"]) == {"math", "code"}


def test_the_math_and_code_config_file_is_a_valid_mixture():
    from areal_jax.config import load_config_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = config_lib.validate(load_config_file(os.path.join(root, "configs", "math_code_qwen.py")), check_paths=False)
    assert job.reward.fn == "mixed" and job.data.train_tasks == job.data.test_tasks == "math,code"
    assert job.reward.timeout_s > job.reward.code_sample_timeout_s  # the sandbox's limits, from code_qwen.py
    from areal_jax.data.sources import for_task

    code, math = for_task(job.data, "code"), for_task(job.data, "math")
    assert "python" in code.system_prompt and "boxed" in math.system_prompt
    assert (code.max_prompt_len, math.max_prompt_len) == (1536, 512)


def test_the_evaluate_program_scores_math_and_code_sets_each_by_its_reward(tmp_path):
    from areal_jax.config import JobConfig
    from areal_jax.programs.evaluate import resolve_settings

    c, math, code = _config(tmp_path)
    given = {"model": c.model.path, "data": f"m={math['test']},c={code['test']}", "tasks": "math,code"}
    settings = resolve_settings(JobConfig(), given)
    r = settings.config.reward
    assert r.fn == "mixed" and r.timeout_s > r.code_sample_timeout_s
    assert any("reward.fn=mixed" in note for note in settings.notes)
    with pytest.raises(ConfigError, match="gives 1 task"):
        resolve_settings(JobConfig(), {**given, "tasks": "math"})


def test_task_overrides_format_each_tasks_files_their_own_way(tmp_path):
    """data.task_overrides: the code files of a mixed run read with their own prompt template and length limit, the
    math files with the section's; the training stream, the evaluation sets and the budget check all apply it."""
    import contextlib

    from areal_jax.data.sources import load_train_prompts
    from areal_jax.evaluation.sets import flatten, load_eval_sets

    c, _, _ = _config(tmp_path)
    c.data.task_overrides = json.dumps({"code": {"prompt_template": "Task: {question}\nProgram:",
                                                 "max_prompt_len": 150}})
    job = config_lib.validate(c)
    tok = build_code_tokenizer()
    stream = load_train_prompts(job.data, tok, seed=0, process_index=0, process_count=1,
                                on_file=lambda path: contextlib.nullcontext())
    for e in stream.take(24):
        text = tok.decode(e.prompt_tokens)
        if e.uid.startswith("code:"):
            assert text.startswith("Task: ") and text.endswith("\nProgram:") and len(e.prompt_tokens) <= 150
        else:
            assert text.startswith("Question: ") and text.endswith("\nAnswer:")
    sets = load_eval_sets(job.data.test_path, tok, job.data, 3)
    assert all(tok.decode(e.prompt_tokens).startswith("Task: ") for e in sets["code"])
    assert all(tok.decode(e.prompt_tokens).startswith("Question: ") for e in flatten({"m": sets["math"]}))
    c.data.task_overrides = json.dumps({"code": {"max_prompt_len": 250}})  # 250 + 8 new tokens > max_len 208
    with pytest.raises(ConfigError, match=r"data.task_overrides\['code'\].max_prompt_len \(250\) \+ rollout"):
        config_lib.validate(c)
    c.data.task_overrides = json.dumps({"code": {"shuffle": False}})
    with pytest.raises(ConfigError, match="'shuffle' cannot differ per task"):
        config_lib.validate(c)
