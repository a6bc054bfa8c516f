"""Synthetic programming tasks and the character-level tokenizer: splits are disjoint and reproducible,
correct targets pass their hidden tests in the sandbox and the warm start's wrong targets fail them."""

import json
import random

import pytest

from areal_jax.data.code_readers import read_code_records
from areal_jax.data.code_synthetic import TEMPLATES, format_target, generate_split, is_test_task, write_splits
from areal_jax.data.code_tokenizer import CODE_VOCAB, build_code_tokenizer
from areal_jax.rewards.code import code_tests_reward


def test_tokenizer_round_trips_ascii_programs_one_token_per_character():
    tok = build_code_tokenizer()
    text = "Question: Write f(x) that returns x%7.\nAnswer: def f(x):\n    return str(x).count('3') ~{}"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.vocab_size == len(CODE_VOCAB) == 100 and tok.eos_token_ids == (CODE_VOCAB.index("<eos>"),)
    assert tok.encode("x", add_special_tokens=True)[0] == tok.bos_token_id


def test_splits_are_disjoint_reproducible_and_hash_assigned():
    train, test = generate_split("train", 300, 0), generate_split("test", 60, 0)
    assert {t.question for t in train}.isdisjoint({t.question for t in test})
    assert all(not is_test_task(t.question) for t in train) and all(is_test_task(t.question) for t in test)
    assert [t.question for t in generate_split("train", 300, 0)] == [t.question for t in train]
    assert len({t.question for t in train}) == 300
    with pytest.raises(ValueError, match="split"):
        generate_split("dev", 1, 0)


def test_tests_come_from_an_independent_evaluation_of_the_template():
    # Each template's meaning, written again here without the template strings.
    meaning = {
        "affine": lambda x, a, b: x * a + b, "affine_swap": lambda x, a, b: x + a * b,
        "mod": lambda x, a, b: x % a, "floordiv": lambda x, a, b: x // a,
        "max": lambda x, a, b: max(x, a), "min": lambda x, a, b: min(x, a),
        "digit_sum": lambda x, a, b: a * sum(map(int, str(x))), "digit_count": lambda x, a, b: a * len(str(x)),
        "count_digit": lambda x, a, b: str(x).count(str(a)), "has_digit": lambda x, a, b: str(a) in str(x),
        "square_plus": lambda x, a, b: x * x + a, "times_plus": lambda x, a, b: x * x * a,
        "divisible": lambda x, a, b: x % a == 0, "minus": lambda x, a, b: x - a, "reverse_minus": lambda x, a, b: a - x,
    }
    assert set(meaning) == set(TEMPLATES)
    for task in generate_split("train", 200, 1):
        expected = [f"assert f({x}) == {meaning[task.template](x, task.a, task.b)!r}" for x in task.inputs]
        assert task.tests == expected


def test_correct_targets_pass_in_the_sandbox_and_wrong_ones_fail(tmp_path):
    paths = write_splits(str(tmp_path), 12, 4, seed=3)
    records, _ = read_code_records(paths["train"], question_field="text")
    rows = [json.loads(line) for line in open(paths["train"])]
    tasks = {t.question: t for t in generate_split("train", 12, 3)}
    rng = random.Random(0)
    for record, row in zip(records, rows):
        task = tasks[row["text"]]
        assert record.question == row["text"] and "assert" not in record.question
        assert code_tests_reward(" " + format_target(task, "correct"), record.answer) == 1.0
        assert code_tests_reward(" " + format_target(task, "confused"), record.answer) == 0.0
        assert code_tests_reward(" " + format_target(task, "slip", rng), record.answer) == 0.0
