"""Synthetic math problems: answers re-derived independently from the text, splits, targets, tokenizer."""
import json
import os
import random
import re
import subprocess
import sys

import pytest

from areal_jax.data import extract_reference_answer, math_words
from areal_jax.data.synthetic_math import (
    DIFFICULTIES,
    Difficulty,
    build_math_tokenizer,
    format_target,
    generate_problem,
    generate_split,
    is_test_problem,
    main,
    write_splits,
)

_ADD = "|".join(math_words.ADD_VERBS)
_SUB = "|".join(math_words.SUB_VERBS)
_STEP = re.compile(rf"(?:{_ADD}) (\d+) more\.|(?:{_SUB}) (\d+)\.")
_WORKED = re.compile(r"(\d+)([+-])(\d+)=(\d+)\.")


def solve_question(question: str) -> tuple[int, list[tuple[str, int]]]:
    """Reads the start count and the steps back out of the question text; returns (answer, steps)."""
    start = int(re.match(r"[A-Za-z]+ has (\d+) [a-z]+\. ", question).group(1))
    steps = [("+", int(a)) if a else ("-", int(b)) for a, b in _STEP.findall(question)]
    assert question.endswith(" have now?")
    value = start
    for op, n in steps:
        value = value + n if op == "+" else value - n
    return value, [("start", start)] + steps


def check_worked(solution: str) -> tuple[list[bool], int, list[tuple[int, str, int, int]]]:
    """Parses "a+b=c." steps: (is each step's arithmetic right, the final "####" value, the steps)."""
    body, final = solution.split(" #### ")
    steps = [(int(a), op, int(b), int(c)) for a, op, b, c in _WORKED.findall(body)]
    assert " ".join(f"{a}{op}{b}={c}." for a, op, b, c in steps) == body  # nothing else in the text
    for (_, _, _, c), (a, _, _, _) in zip(steps, steps[1:]):
        assert a == c  # each step continues from the previous result
    right = [(a + b if op == "+" else a - b) == c for a, op, b, c in steps]
    return right, int(final), steps


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTIES))
def test_answers_verified_by_independent_evaluation(difficulty):
    rng = random.Random(7)
    d = DIFFICULTIES[difficulty]
    for _ in range(300):
        problem = generate_problem(rng, difficulty)
        answer, q_steps = solve_question(problem.question)
        right, final, steps = check_worked(problem.solution)
        assert all(right) and final == answer == problem.answer
        assert [(op, b) for _, op, b, _ in steps] == q_steps[1:]
        assert steps[0][0] == q_steps[0][1]
        assert d.min_steps <= len(steps) <= d.max_steps
        assert d.start_min <= q_steps[0][1] <= d.start_max
        assert all(d.operand_min <= b <= d.operand_max for _, _, b, _ in steps)
        assert all(c >= 0 for *_, c in steps)  # counts never go negative
        assert problem.to_json() == {"question": problem.question, "answer": problem.solution}


def test_default_is_easy_and_matches_the_documented_layout():
    problem = generate_problem(random.Random(0))
    assert DIFFICULTIES["easy"] == Difficulty(2, 3, 10, 99, 1, 9)
    right, final, steps = check_worked(problem.solution)
    assert problem.solution.endswith(f" #### {problem.answer}") and 2 <= len(steps) <= 3
    with pytest.raises(ValueError, match="min_steps"):
        Difficulty(min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="Unknown difficulty"):
        generate_problem(random.Random(0), "impossible")


def test_target_styles():
    rng = random.Random(3)
    for _ in range(300):
        problem = generate_problem(rng, random.choice(sorted(DIFFICULTIES)))
        assert format_target(problem, "answer_only") == f"#### {problem.answer}"
        assert format_target(problem, "worked") == problem.solution
        slip = format_target(problem, "slip")
        right, final, steps = check_worked(slip)
        assert right.count(False) == 1  # exactly one arithmetic slip
        assert final == steps[-1][3] != problem.answer
        assert [(op, b) for _, op, b, _ in steps] == [(op, b) for op, b, _ in problem.steps]
        assert steps[0][0] == problem.start and all(c >= 0 for *_, c in steps)
        assert format_target(problem, "slip") == slip  # reproducible without an rng
    with pytest.raises(ValueError, match="Unknown target style"):
        format_target(problem, "essay")


def test_splits_disjoint_exact_and_seeded(tmp_path):
    paths = write_splits(str(tmp_path / "a"), n_train=400, n_test=120, seed=5)
    rows = {s: [json.loads(line) for line in open(p)] for s, p in paths.items()}
    assert len(rows["train"]) == 400 and len(rows["test"]) == 120
    train_q = {r["question"] for r in rows["train"]}
    test_q = {r["question"] for r in rows["test"]}
    assert len(train_q) == 400 and len(test_q) == 120 and not train_q & test_q
    assert all(is_test_problem(q) for q in test_q) and not any(is_test_problem(q) for q in train_q)
    # Same seed, same files; another seed gives other problems, still disjoint from this train split.
    again = write_splits(str(tmp_path / "b"), n_train=400, n_test=120, seed=5)
    assert open(again["train"]).read() == open(paths["train"]).read()
    other_test = {p.question for p in generate_split("test", 120, seed=6)}
    assert other_test != test_q and not other_test & train_q
    # Every stored answer is the GSM8K "####" answer of its question.
    for row in rows["test"]:
        assert int(extract_reference_answer(row["answer"], "gsm8k")) == solve_question(row["question"])[0]


def test_tokenizer_round_trips_everything():
    tok = build_math_tokenizer()
    assert tok.vocab_size < 80
    unk = tok.token_to_id(math_words.UNK)
    rng = random.Random(11)
    for i in range(400):
        problem = generate_problem(rng, sorted(DIFFICULTIES)[i % 3])
        texts = [problem.question, f"Question: {problem.question}\nAnswer: {problem.solution}"]
        texts += [format_target(problem, s) for s in ("worked", "answer_only", "slip")]
        for text in texts:
            ids = tok.encode(text)
            assert unk not in ids and tok.decode(ids) == text
        # Numbers are split into single digits.
        assert all(len(t.strip()) == 1 for t in tok.convert_ids_to_tokens(tok.encode(str(problem.start))))
    prompt = tok.apply_chat_template([{"role": "user", "content": problem.question}], tokenize=True)
    assert prompt == tok.encode(f"Question: {problem.question}\nAnswer:", add_special_tokens=True)
    assert prompt[0] == tok.bos_token_id and tok.decode(prompt) == f"Question: {problem.question}\nAnswer:"
    full = tok.apply_chat_template([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
                                   add_generation_prompt=False)
    assert full == "<bos>Question: Q\nAnswer: A<eos>"
    with pytest.raises(ValueError, match="only user and assistant"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_math_tokenizer_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is needed for the parity check")
    tok = build_math_tokenizer()
    tok.save_pretrained(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    problem = generate_problem(random.Random(1))
    text = f"Question: {problem.question}\nAnswer: {problem.solution}"
    assert hf.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=True)
    assert hf.decode(tok.encode(text), skip_special_tokens=True) == text
    assert hf.eos_token_id == tok.eos_token_id and len(hf) == tok.vocab_size


def test_cli(tmp_path):
    main(["--out", str(tmp_path / "x"), "--n_train", "20", "--n_test", "5", "--seed", "2"])
    assert sum(1 for _ in open(tmp_path / "x" / "train.jsonl")) == 20
    out = subprocess.run([sys.executable, "-m", "areal_jax.data.synthetic_math", "--out", str(tmp_path / "y"),
                          "--n_train", "20", "--n_test", "5", "--seed", "2"], capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "wrote 20 problems" in out.stdout
    assert open(tmp_path / "y" / "test.jsonl").read() == open(tmp_path / "x" / "test.jsonl").read()
