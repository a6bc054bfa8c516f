"""Several evaluation sets (data.test_path = NAME=PATH,NAME=PATH): how the list is read and rejected, each set's
figures worked by hand from its problem records, and one evaluation of two sets whose pooled and per-set figures
follow from the records it writes (each record re-scored directly)."""
import json
import os

import pytest

from areal_jax.config import ConfigError, JobConfig, validate
from areal_jax.evaluation.in_job import result_lines
from areal_jax.evaluation.sets import EvalSet, metric_items, parse_eval_sets, set_figures
from areal_jax.programs.report import eval_set_names
from areal_jax.programs.rl import format_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH = os.path.join(ROOT, "assets", "math_reasoner")


def test_a_list_of_sets_is_named_by_its_names_or_file_stems():
    assert parse_eval_sets("") == []
    assert parse_eval_sets("/d/gsm8k.jsonl") == [EvalSet("gsm8k", "/d/gsm8k.jsonl")]
    assert parse_eval_sets("gsm8k=/d/test.jsonl, math-500=/m/test.parquet") == [
        EvalSet("gsm8k", "/d/test.jsonl"), EvalSet("math-500", "/m/test.parquet")]
    assert parse_eval_sets("/d/a.jsonl,b=/d/a.jsonl") == [EvalSet("a", "/d/a.jsonl"), EvalSet("b", "/d/a.jsonl")]
    # a "=" inside a path's directories is part of the path
    assert parse_eval_sets("/runs/lr=1e-3/test.jsonl") == [EvalSet("test", "/runs/lr=1e-3/test.jsonl")]


@pytest.mark.parametrize("value, needle", [
    ("/d/test.jsonl,/m/test.jsonl", "two files are named 'test'; name them apart as NAME=PATH,NAME=PATH"),
    ("a.jsonl,,b.jsonl", "has an empty item"),
    ("my set=/d/a.jsonl", "the name 'my set' may only hold letters"),
    ("a=", "'a' names no file"),
])
def test_a_bad_list_of_sets_says_what_is_wrong(value, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        parse_eval_sets(value)


def test_the_job_config_names_the_missing_file_of_a_set(tmp_path):
    (tmp_path / "train.jsonl").write_text("{}\n")
    c = JobConfig().replace(model=JobConfig().model.replace(path=MATH))
    good = f"{MATH}/data/test.jsonl"

    def config(test_path):
        return c.replace(data=c.data.replace(train_path=str(tmp_path / "train.jsonl"), test_path=test_path))

    validate(config(f"a={good},b={good}"))
    with pytest.raises(ConfigError, match=r"--config.data.test_path: '/nowhere.jsonl' \(the file named 'b'\) does not exist"):
        validate(config(f"a={good},b=/nowhere.jsonl"))
    with pytest.raises(ConfigError, match=r"--config.data.test_path='/nowhere.jsonl' does not exist\."):
        validate(config("/nowhere.jsonl"))
    with pytest.raises(ConfigError, match="two files are named 'test'"):
        validate(config(f"{good},{good}"))


def _record(greedy, samples, first=None):
    out = {"greedy_reward": greedy, "sample_rewards": samples, "correct": sum(r >= 1.0 for r in samples)}
    if first is not None:
        out.update(greedy_first_reward=first[0], sample_first_rewards=first[1],
                   correct_first=sum(r >= 1.0 for r in first[1]))
    return out


def test_a_sets_figures_worked_by_hand():
    problems = [_record(1.0, [1.0, 0.0, 1.0, 0.0]), _record(0.0, [0.0] * 4), _record(1.0, [1.0] * 4)]
    got = set_figures(problems, k=4)
    # greedy 2 of 3; sampled (2 + 0 + 4) / 12; pass@4: a problem with any correct sample passes, 2 of 3
    assert got == pytest.approx({"n": 3, "greedy_pass@1": 2 / 3, "sampled_pass@1": 0.5, "pass@4": 2 / 3})
    assert set_figures(problems, k=0) == pytest.approx({"n": 3, "greedy_pass@1": 2 / 3})
    # a repair evaluation: the plain figures are the first attempts', repair_* the last ones'
    repaired = [_record(1.0, [1.0, 1.0], first=(0.0, [1.0, 0.0])), _record(0.0, [0.0, 1.0], first=(0.0, [0.0, 0.0]))]
    got = set_figures(repaired, k=2)
    assert got == pytest.approx({"n": 2, "greedy_pass@1": 0.0, "sampled_pass@1": 0.25, "pass@2": 0.5,
                                 "repair_greedy_pass@1": 0.5, "repair_sampled_pass@1": 0.75, "repair_pass@2": 1.0})


def test_a_multi_set_result_reaches_the_metrics_the_log_the_summary_and_the_plot():
    res = {"n": 5, "greedy_pass@1": 0.6, "sampled_pass@1": 0.5, "seconds": 2.0, "tokens_per_s": 100.0,
           "sets": {"gsm8k": {"n": 3, "greedy_pass@1": 2 / 3, "sampled_pass@1": 0.5},
                    "math500": {"n": 2, "greedy_pass@1": 0.5, "sampled_pass@1": 0.5}}}
    items = metric_items(res)
    assert items["eval/greedy_pass@1"] == 0.6 and items["eval/gsm8k/greedy_pass@1"] == 2 / 3
    assert items["eval/math500/n"] == 2.0 and "eval/sets" not in items
    lines = result_lines("end", res)
    assert lines[0].startswith("[eval end] greedy pass@1 = 0.600 on 5 problems (all 2 sets)")
    assert lines[1:] == ["[eval end]   gsm8k: greedy pass@1 0.667, sampled pass@1 0.500 on 3 problems",
                         "[eval end]   math500: greedy pass@1 0.500, sampled pass@1 0.500 on 2 problems"]
    start = {**res, "sets": {"gsm8k": {"n": 3, "greedy_pass@1": 0.0}, "math500": {"n": 2, "greedy_pass@1": 0.5}}}
    run = {"steps": 4, "wall_s": 10.0}
    table = format_summary({**run, "evaluations": {"start": start, "end": res}})
    assert "  gsm8k: greedy pass@1" in table and "66.7%" in table and "  math500: greedy pass@1" in table
    assert eval_set_names([{"step": 0, **metric_items(start)}, {"step": 4, **items}]) == ["gsm8k", "math500"]
    one_set = {k: v for k, v in res.items() if k != "sets"}
    assert len(result_lines("end", one_set)) == 1 and "all" not in result_lines("end", one_set)[0]
    assert "gsm8k" not in format_summary({**run, "evaluations": {"end": one_set}})


def test_two_sets_in_one_pass_give_each_sets_figures_from_its_records(tmp_path):
    from areal_jax.programs.evaluate import evaluate, resolve_settings, summary_line
    from areal_jax.rewards.math import math_reward

    test = f"{MATH}/data/test.jsonl"
    rows = open(test).read().splitlines()
    other = tmp_path / "later.jsonl"
    other.write_text("\n".join(rows[40:60]) + "\n")
    out = str(tmp_path / "records.jsonl")
    given = {"model": MATH, "data": f"first={test},later={other}", "n": 6, "k": 2, "max_new_tokens": 48}
    res = evaluate(resolve_settings(JobConfig(), given, out=out), log=lambda *_: None)
    problems = [json.loads(line) for line in open(out)]
    assert [p["set"] for p in problems] == ["first"] * 6 + ["later"] * 6
    # each uid starts with its set's name, as a training mixture's keys do
    assert [p["uid"] for p in problems] == ([f"first:{i}:0" for i in range(1, 7)]
                                            + [f"later:{i}:0" for i in range(1, 7)])
    assert res["n"] == 12 and list(res["sets"]) == ["first", "later"]
    for p in problems:  # every reward re-scored directly, without the pool
        line = int(p["uid"].split(":")[1])
        answer = json.loads((rows[40:60] if p["set"] == "later" else rows)[line - 1])["answer"]
        assert p["greedy_reward"] == math_reward(p["greedy"], answer)
        assert p["sample_rewards"] == [math_reward(t, answer) for t in p["samples"]]
    for name, figures in res["sets"].items():
        mine = [p for p in problems if p["set"] == name]
        assert figures["n"] == 6
        assert figures["greedy_pass@1"] == pytest.approx(sum(p["greedy_reward"] >= 1.0 for p in mine) / 6)
        assert figures["sampled_pass@1"] == pytest.approx(sum(p["correct"] for p in mine) / 12)
        assert figures["pass@2"] == pytest.approx(sum(p["correct"] > 0 for p in mine) / 6)
    for key in ("greedy_pass@1", "sampled_pass@1", "pass@2"):  # the pass pools the two sets' problems
        assert res[key] == pytest.approx(sum(f[key] for f in res["sets"].values()) / 2)
    text = summary_line(res).splitlines()
    assert text[0].startswith(f"{MATH} on all 2 sets (12 problems)") and text[1].startswith("  first: greedy")


def test_a_job_evaluates_each_set_and_logs_each_sets_figures(tmp_path):
    """The tiny job with two test sets: its start and end evaluations write one records file each, every record
    naming its set; metrics.jsonl and the summary hold each set's figures, those the records give."""
    from areal_jax import config as config_lib
    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config

    c = tiny_config(str(tmp_path), eta=1, steps=1)
    test = c.data.test_path
    c.data.test_path = f"easy={test},hard={test}"
    c.eval.n_test, c.eval.samples, c.eval.max_new_tokens, c.eval.num_slots = 3, 1, 4, 8
    lines = []
    job = RLJob(config_lib.validate(c), log_fn=lines.append)
    try:
        summary = job.run()
    finally:
        job.close()
    metrics = [json.loads(line) for line in open(os.path.join(c.run_dir, "metrics.jsonl"))]
    for tag in ("start", "end"):
        records = [json.loads(line) for line in open(os.path.join(c.run_dir, "evaluations", f"{tag}.jsonl"))]
        assert [r["set"] for r in records] == ["easy"] * 3 + ["hard"] * 3
        res = summary["evaluations"][tag]
        assert res["n"] == 6 and list(res["sets"]) == ["easy", "hard"]
        for name in ("easy", "hard"):
            mine = [r for r in records if r["set"] == name]
            assert res["sets"][name] == pytest.approx(set_figures(mine, k=1))
            logged = [m[f"eval/{name}/greedy_pass@1"] for m in metrics if f"eval/{name}/greedy_pass@1" in m]
            assert res["sets"][name]["greedy_pass@1"] in logged
        assert any(line.startswith(f"[eval {tag}]   easy: greedy pass@1") for line in lines)


def test_a_set_with_its_own_budget(tmp_path):
    """eval.set_max_new_tokens: the first set's completions stop at 3 tokens (each the start of what it writes with
    the whole budget), the other set's are those of an evaluation without it; a bad list fails in the config."""
    from areal_jax.programs.evaluate import evaluate, resolve_settings
    from areal_jax.tokenizer import Tokenizer

    test = f"{MATH}/data/test.jsonl"
    other = tmp_path / "later.jsonl"
    other.write_text("\n".join(open(test).read().splitlines()[40:50]) + "\n")
    given = {"model": MATH, "data": f"first={test},later={other}", "n": 4, "k": 0, "max_new_tokens": 40}
    runs = {}
    for name, budgets in (("whole", ""), ("own", "first=3")):
        out = str(tmp_path / f"{name}.jsonl")
        evaluate(resolve_settings(JobConfig(), {**given, "set_max_new_tokens": budgets}, out=out),
                 log=lambda *_: None)
        runs[name] = [json.loads(line) for line in open(out)]
    tok = Tokenizer.from_pretrained(MATH)
    for whole, own in zip(runs["whole"], runs["own"]):
        if own["set"] == "first":
            assert len(tok.encode(own["greedy"])) <= 3 and whole["greedy"].startswith(own["greedy"])
            assert own["greedy_finish"] == "length" or own["greedy"] == whole["greedy"]
        else:
            assert own["greedy"] == whole["greedy"]
    assert any(len(tok.encode(p["greedy"])) > 3 for p in runs["whole"] if p["set"] == "first")
    (tmp_path / "train.jsonl").write_text("{}\n")
    c = JobConfig().replace(model=JobConfig().model.replace(path=MATH))
    c = c.replace(data=c.data.replace(train_path=str(tmp_path / "train.jsonl"), test_path=f"first={test},later={other}"))
    validate(c.replace(eval=c.eval.replace(set_max_new_tokens="later=7")))
    for value, needle in (("gsm8k=3", "'gsm8k=3' must be NAME=N with NAME one of the evaluation sets (first, later)"),
                          ("first=0", "first's budget '0' must be a positive integer")):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            validate(c.replace(eval=c.eval.replace(set_max_new_tokens=value)))
