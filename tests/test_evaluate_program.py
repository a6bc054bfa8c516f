"""`python -m areal_jax.programs.evaluate`: where its settings come from, its errors, and its results checked
against the records it writes, re-scored directly and counted by enumeration."""
import itertools
import json
import os
import subprocess
import sys

import pytest

from areal_jax.config import ConfigError, JobConfig, from_config_dict
from areal_jax.programs.evaluate import EvalSettings, evaluate, flag_names, pass_at_powers, resolve_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH = os.path.join(ROOT, "assets", "math_reasoner")
CODE = os.path.join(ROOT, "assets", "code_reasoner")


def _config_file(name: str) -> JobConfig:
    from areal_jax.config import load_config_file

    return from_config_dict(load_config_file(os.path.join(ROOT, "configs", name)))


def test_flags_override_the_config_file_and_the_rest_of_the_file_applies():
    base = _config_file("code.py")
    s = resolve_settings(base, {"n": 7, "k": 3, "temperature": 0.6}, top_p=0.95)
    c = s.config
    assert (c.eval.n_test, c.eval.samples, c.rollout.temperature, s.top_p) == (7, 3, 0.6, 0.95)
    # untouched: the file's data formatting, reward and its limits, completion budget
    assert (c.data.task, c.data.question_field, c.data.max_prompt_len) == ("code", "text", 88)
    assert (c.reward.fn, c.reward.timeout_s, c.reward.code_sample_timeout_s) == ("code", 15.0, 8.0)
    assert c.eval.max_new_tokens == base.eval.max_new_tokens == 56
    assert c.model.path == base.model.path


def test_training_side_limits_of_the_job_config_do_not_reject_an_evaluation():
    given = {"model": MATH, "data": f"{MATH}/data/test.jsonl", "max_prompt_len": 1024, "max_new_tokens": 4096}
    s = resolve_settings(_config_file("math.py"), given)
    assert (s.config.data.max_prompt_len, s.config.eval.max_new_tokens) == (1024, 4096)


def test_a_code_task_scores_with_the_sandbox_and_a_worker_limit_above_the_tests():
    given = {"model": CODE, "data": f"{CODE}/data/test.jsonl", "task": "code", "code_sample_timeout_s": 30.0}
    s = resolve_settings(JobConfig(), given)
    assert s.config.reward.fn == "code"
    assert s.config.reward.timeout_s > s.config.reward.code_sample_timeout_s == 30.0
    assert any("code sandbox" in n for n in s.notes)
    s = resolve_settings(JobConfig(), {**given, "reward_timeout_s": 40.0})  # an explicit limit is kept
    assert s.config.reward.timeout_s == 40.0
    assert s.config.reward.code_output_match == "numbers"  # the default; a flag chooses another
    assert resolve_settings(JobConfig(), {**given, "code_output_match": "lines"}).config.reward.code_output_match == "lines"
    math = resolve_settings(JobConfig(), {"model": MATH, "data": f"{MATH}/data/test.jsonl"})
    assert (math.config.data.task, math.config.reward.fn) == ("math", "math")


@pytest.mark.parametrize("given,kw,needle", [
    ({"model": CODE, "data": f"{CODE}/data/test.jsonl", "reward_fn": "code"}, {}, "--task=code"),
    ({"model": MATH, "data": "missing.jsonl"}, {}, "--data='missing.jsonl' does not exist"),
    ({"model": MATH}, {}, "no evaluation data"),
    ({"model": "nowhere", "data": f"{MATH}/data/test.jsonl"}, {}, "--model='nowhere' is not a directory"),
    ({"model": MATH, "data": f"{MATH}/data/test.jsonl", "n": 0}, {}, "--n=0"),
    ({"model": MATH, "data": f"{MATH}/data/test.jsonl"}, {"top_p": 0.0}, "--top_p=0.0"),
    ({"model": MATH, "data": f"{MATH}/data/test.jsonl", "temperature": 0.0}, {}, "--temperature=0.0"),
    ({"model": MATH, "data": f"{MATH}/data/test.jsonl"}, {"out": "/no/such/dir/x.jsonl"}, "not a writable directory"),
    ({"model": CODE, "data": f"{CODE}/data/test.jsonl", "task": "code", "reward_timeout_s": 3.0}, {},
     "--reward_timeout_s=3.0 must exceed"),
])
def test_bad_settings_fail_before_anything_loads_and_name_the_flag(given, kw, needle):
    with pytest.raises(ConfigError) as e:
        resolve_settings(JobConfig(), given, **kw)
    assert needle in flag_names(str(e.value))


def test_flag_names_map_config_keys_to_this_programs_flags():
    text = "pass --config.data.question_field=<x>, or --config.data.on_bad_row=skip; --config.train.lr stays"
    assert flag_names(text) == "pass --question_field=<x>, or --on_bad_row=skip; --config.train.lr stays"


def test_pass_at_powers_equals_subset_enumeration():
    correct, k = [0, 1, 3, 8, 5], 8
    got = pass_at_powers(correct, k)
    assert sorted(got) == ["pass@1", "pass@2", "pass@4", "pass@8"]
    for j in (1, 2, 4, 8):
        want = sum(sum(any(i < c for i in sub) for sub in itertools.combinations(range(k), j))
                   / len(list(itertools.combinations(range(k), j))) for c in correct) / len(correct)
        assert got[f"pass@{j}"] == pytest.approx(want)


def _examples(settings: EvalSettings) -> list:
    from areal_jax.evaluation.scoring import load_eval_examples
    from areal_jax.tokenizer import Tokenizer

    c = settings.config
    return load_eval_examples(c.data.test_path, Tokenizer.from_pretrained(c.model.path), c.data, c.eval.n_test)


def _check_against_records(res: dict, problems: list[dict], examples: list, reward, k: int) -> None:
    """Every figure of ``res`` follows from the records, and each record's rewards from scoring its completions
    directly (no pool, no cache, no streaming)."""
    assert len(problems) == res["n"] == len(examples)
    for p, e in zip(problems, examples):
        assert p["uid"] == e.uid and p["question"] == e.question
        assert p["greedy_reward"] == reward(p["greedy"], e.answer)
        assert p["sample_rewards"] == [reward(t, e.answer) for t in p["samples"]]
        assert p["correct"] == sum(r >= 1.0 for r in p["sample_rewards"]) and len(p["samples"]) == k
    assert res["greedy_pass@1"] == pytest.approx(sum(p["greedy_reward"] >= 1.0 for p in problems) / len(problems))
    assert res["sampled_pass@1"] == pytest.approx(sum(p["correct"] for p in problems) / (k * len(problems)))
    assert res[f"pass@{k}"] == pytest.approx(sum(p["correct"] > 0 for p in problems) / len(problems))


@pytest.mark.slow
def test_code_evaluation_matches_its_records_scored_directly(tmp_path):
    from areal_jax.rewards.code import code_tests_reward

    out = str(tmp_path / "records.jsonl")
    s = resolve_settings(_config_file("code.py"), {"n": 12, "k": 4}, out=out)
    lines = []
    res = evaluate(s, log=lines.append)
    problems = [json.loads(line) for line in open(out)]
    reward = lambda text, answer: code_tests_reward(text, answer, case_timeout_s=8.0, sample_timeout_s=8.0)  # noqa: E731
    _check_against_records(res, problems, _examples(s), reward, 4)
    assert 0 < res["greedy_pass@1"] < 1  # the warm start solves some tasks, not all: the rewards discriminate
    assert res["task"] == "code" and lines[0].startswith("Evaluating") and "reward code" in lines[0]
    assert any(line.startswith("[eval] 60 / 60 sequences") for line in lines)


@pytest.mark.slow
def test_a_vanishing_nucleus_samples_the_greedy_completion(tmp_path):
    """top_p reaches the sampled requests: with a nucleus of one token every sample is the greedy completion."""
    from areal_jax.rewards.math import math_reward

    given = {"model": MATH, "data": f"{MATH}/data/test.jsonl", "n": 16, "k": 3, "max_new_tokens": 48}
    out = str(tmp_path / "records.jsonl")
    res = evaluate(resolve_settings(JobConfig(), given, top_p=1e-6, out=out), log=lambda *_: None)
    problems = [json.loads(line) for line in open(out)]
    assert all(p["samples"] == [p["greedy"]] * 3 for p in problems)
    _check_against_records(res, problems, _examples(resolve_settings(JobConfig(), given)), math_reward, 3)
    evaluate(resolve_settings(JobConfig(), given, out=out), log=lambda *_: None)  # the whole distribution
    assert any(p["samples"] != [p["greedy"]] * 3 for p in map(json.loads, open(out)))


def test_the_command_line_reports_bad_flags_with_exit_status_2(tmp_path):
    cmd = [sys.executable, "-m", "areal_jax.programs.evaluate", f"--model={MATH}", "--data=nowhere.jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "Config error: --data='nowhere.jsonl' does not exist." in r.stderr
    cmd = [sys.executable, "-m", "areal_jax.programs.evaluate", "--config=configs/code.py", "--run_dir=runs/x"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "not both" in r.stderr
    bad = tmp_path / "bad.jsonl"  # a code task whose tests are not a list: the file, its line and this flag
    bad.write_text(json.dumps({"question": "Add.", "tests": "assert f(1) == 2"}) + "\n{\n")
    cmd = [sys.executable, "-m", "areal_jax.programs.evaluate", f"--model={CODE}", f"--data={bad}", "--task=code"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and f"Error: {bad}, line 1: " in r.stderr, r.stderr[-2000:]
    assert r.stderr.rstrip().endswith("Fix the row, or skip such rows with --on_bad_row=skip."), r.stderr[-2000:]


@pytest.mark.slow
def test_the_command_line_evaluates_a_config_file_and_prints_one_json_line(tmp_path):
    out = tmp_path / "records.jsonl"
    cmd = [sys.executable, "-m", "areal_jax.programs.evaluate", "--config=configs/code.py",
           "--config.eval.n_test=6", "--k=2", f"--out={out}"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert (res["n"], res["k"], res["task"]) == (6, 2, "code")
    assert len(out.read_text().splitlines()) == 6


@pytest.mark.slow
def test_a_model_split_over_devices_or_replicated_gives_the_one_device_completions(tmp_path):
    """--tensor=2 shards the weights and the KV cache over two of the test's four CPU devices (the sums of the
    projections then split in two, so logits differ in the last bits); --replicas=2 decodes with two engines side by
    side, each holding the whole model (and with --tensor=2, over two devices each): the same greedy completions."""
    import jax

    assert len(jax.local_devices()) >= 4
    given = {"model": MATH, "data": f"{MATH}/data/test.jsonl", "n": 24, "k": 0, "max_new_tokens": 48}
    outs = []
    for tensor, replicas in ((1, 1), (2, 1), (1, 2), (2, -1)):
        out = str(tmp_path / f"t{tensor}r{replicas}.jsonl")
        res = evaluate(resolve_settings(JobConfig(), given, tensor=tensor, out=out, replicas=replicas),
                       log=lambda *_: None)
        assert (res["tensor"], res["replicas"]) == (tensor, replicas if replicas > 0 else 2)
        outs.append([json.loads(line)["greedy"] for line in open(out)])
    assert all(o == outs[0] for o in outs[1:])
    with pytest.raises(ValueError, match="more devices than this host has"):
        evaluate(resolve_settings(JobConfig(), given, tensor=64), log=lambda *_: None)
    with pytest.raises(ValueError, match="more devices than this host has"):
        evaluate(resolve_settings(JobConfig(), given, tensor=2, replicas=3), log=lambda *_: None)
