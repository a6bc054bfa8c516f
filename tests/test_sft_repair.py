"""The repair warm start (configs/sft_code_repair.py): two-attempt rows laid out token for token as a rollout's
repair turn is, wrong first attempts that really fail the shown test, and the config checks of its styles."""
import functools
import json
import os
import random
import re
import time

import ml_collections
import numpy as np
import pytest

from areal_jax.data.code_readers import read_code_records
from areal_jax.data.code_synthetic import (
    REPAIR_TEMPLATE,
    build_tokenizer,
    format_target,
    generate_split,
    repair_target,
    write_splits,
)
from areal_jax.knobs import ConfigError, load_config_file
from areal_jax.programs.sft import encode_repair_example
from areal_jax.rewards.code import code_tests_reward
from areal_jax.rewards.code_feedback import code_feedback
from areal_jax.sampler.requests import Completion
from areal_jax.sampler.turns import FeedbackTurns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(program: str, x: int):
    scope: dict = {}
    exec(program, scope)  # noqa: S102 - the task's own generated program
    return scope["f"](x)


def test_repair_targets_fail_the_first_test_and_their_repairs_pass_all(tmp_path):
    """The wrong attempt of a repair target returns something other than the first test's expected value (worked
    out here by running both programs directly, not through the sandbox); its feedback names the input, what came
    back and what was expected; the repair passes every hidden test in the sandbox. A wrong program that happens to
    pass the first test gives no target."""
    paths = write_splits(str(tmp_path), 40, 4, seed=5)
    records = {r.question: r for r in read_code_records(paths["train"], question_field="text")[0]}
    tasks = generate_split("train", 40, 5)
    made = skipped = 0
    for i, task in enumerate(tasks):
        rng = random.Random(i)
        state = rng.getstate()
        parts = repair_target(task, rng)
        rng.setstate(state)  # the same draw again: the wrong program repair_target chose
        wrong = format_target(task, "confused" if rng.random() < 0.5 else "slip", rng)
        x = task.inputs[0]
        got, expected = _run(wrong, x), _run(task.code, x)
        if parts is None:
            assert got == expected
            skipped += 1
            continue
        first, feedback, repair = parts
        assert first == wrong and repair == task.code and got != expected
        assert f"f({x})" in feedback and str(got) in feedback and str(expected) in feedback
        assert code_tests_reward(" " + repair, records[task.question].answer) == 1.0
        assert code_tests_reward(" " + first, records[task.question].answer) == 0.0
        made += 1
    assert made >= 25 and skipped >= 1


def test_a_repair_row_is_what_the_rollout_shows_and_trains_only_the_repair(tmp_path):
    """encode_repair_example's context (first attempt + <eos> + templated feedback) is token for token the prompt
    of the continuation FeedbackTurns builds after that first attempt, with the feedback computed from the reader's
    answer; the loss mask covers exactly " " + repair + <eos>."""
    tok = build_tokenizer()
    eos = tok.eos_token_id
    paths = write_splits(str(tmp_path), 30, 4, seed=2)
    records = {r.question: r for r in read_code_records(paths["train"], question_field="text")[0]}
    task = next(t for t in generate_split("train", 30, 2) if repair_target(t, random.Random(0)) is not None)
    first, feedback, repair = repair_target(task, random.Random(0))
    prompt = tok.encode(f"Question: {task.question}\nAnswer:")
    ids, mask = encode_repair_example(tok, prompt, first, feedback, repair, REPAIR_TEMPLATE)

    target = tok.encode(" " + repair) + [eos]
    assert ids[mask == 1].tolist() == target and mask[-len(target):].all() and not mask[:-len(target)].any()
    assert tok.decode(ids[len(prompt):len(ids) - len(target)].tolist()).startswith(" " + first)

    turns = FeedbackTurns(turns=1, template=REPAIR_TEMPLATE, encode=tok.encode, decode=tok.decode,
                          feedback=functools.partial(code_feedback, cases=1), max_new_tokens=400, max_len=512)
    try:
        attempt = np.asarray(tok.encode(" " + first) + [eos], np.int32)
        done = turns.add(("g", 0), Completion("g", 0, prompt, attempt, np.zeros(len(attempt), np.float32),
                                              np.zeros(len(attempt), np.int32), "stop"),
                         prompt, records[task.question].answer)
        assert not done
        deadline = time.monotonic() + 60
        requests = []
        while not requests and time.monotonic() < deadline:
            _, requests = turns.poll()
            time.sleep(0.02)
    finally:
        turns.close()
    assert len(requests) == 1
    assert requests[0].prompt == ids[:len(ids) - len(target)].tolist()


def test_repair_config_loads_and_bad_styles_or_start_points_are_config_errors(tmp_path):
    from areal_jax.programs.sft_config import from_config_dict, task_styles

    path = os.path.join(ROOT, "configs", "sft_code_repair.py")
    cd = load_config_file(path)
    typed = from_config_dict(cd)
    assert typed.init_from == "assets/code_reasoner" and typed.stages[0].mix["repair"] == 0.5
    assert set(task_styles("code")) == {"correct", "confused", "slip", "repair"}
    assert "repair" not in task_styles("math")

    bad = load_config_file(path)
    bad.stages[0].mix = {"repair": 0.5, "fixed": 0.5}
    with pytest.raises(ConfigError, match=r"stages\[0\]\.mix names \['fixed'\].*'repair'"):
        from_config_dict(bad)
    bad = load_config_file(path)
    bad.task = "math"
    with pytest.raises(ConfigError, match=r"not target styles of task 'math'"):
        from_config_dict(bad)
    bad = load_config_file(path)
    bad.init_from = str(tmp_path)
    with pytest.raises(ConfigError, match=r"init_from=.* is not an HF checkpoint directory"):
        from_config_dict(bad)


def test_the_code_repair_job_config_matches_its_warm_start():
    """configs/code_repair.py: one repair turn whose template is the warm start's, room for both attempts within the
    model's positions, and a valid job config."""
    from areal_jax.config import from_config_dict

    c = from_config_dict(load_config_file(os.path.join(ROOT, "configs", "code_repair.py")))
    assert c.rollout.feedback_turns == 1 and c.rollout.feedback_template == REPAIR_TEMPLATE
    with open(os.path.join(ROOT, c.model.path, "config.json")) as f:
        assert c.rollout.max_len <= json.load(f)["max_position_embeddings"]
    assert c.data.max_prompt_len + c.rollout.max_new_tokens <= c.rollout.max_len
    assert re.search(r"\{feedback\}", c.rollout.feedback_template)


@pytest.mark.slow
def test_sft_continues_a_warm_start_on_repair_rows_and_evaluates_the_repair_turn(tmp_path):
    """init_from: the second run starts from the first's weights (its first loss is the first run's level, not a
    new model's) and its final evaluation reports first-attempt and after-repair figures."""
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.programs.sft import run

    def config(out, stages, init_from=""):
        c = ml_collections.ConfigDict()
        c.task, c.out_dir, c.seed, c.batch_size, c.seq_len, c.max_new_tokens = "code", str(tmp_path / out), 0, 8, 240, 24
        c.init_from = init_from
        c.eval_n, c.eval_slots = 6, 8
        c.data = ml_collections.ConfigDict(dict(n_train=60, n_test=10, seed=0, difficulty="default"))
        c.model = ml_collections.ConfigDict(dict(architecture="qwen2", hidden_size=32, intermediate_size=64,
                                                 num_layers=1, num_heads=2, num_kv_heads=1,
                                                 max_position_embeddings=256))
        c.stages = [ml_collections.ConfigDict(dict(name=n, mix=mix, lr=3e-3, warmup_steps=1, max_steps=steps,
                                                   max_minutes=5.0, eval_every=steps, stop_above=None,
                                                   stop_below=None)) for n, mix, steps in stages]
        return c

    repair = [("repair", {"repair": 0.5, "confused": 0.5}, 2)]
    run(config("base", [("correct", {"correct": 1.0}, 30)]))
    cont = run(config("cont", repair, init_from=str(tmp_path / "base")))
    fresh = run(config("fresh", repair))  # the same two steps from a new model
    assert cont["stages"][0]["loss"] < fresh["stages"][0]["loss"] - 1.0
    final = cont["final"]
    assert {"greedy_pass@1", "repair_greedy_pass@1", "repair_share"} <= set(final)
    assert final["repair_greedy_pass@1"] >= final["greedy_pass@1"]
    assert load_hf_checkpoint(str(tmp_path / "cont")).cfg.hidden_size == 32
