"""Synthetic multi-step arithmetic word problems with integer answers, in the GSM8K JSONL layout.

A problem starts from a count and applies a few additions and subtractions:

    question: "Tom has 57 apples. Tom buys 5 more. Then Tom gives away 6. How many apples does Tom have now?"
    answer:   "57+5=62. 62-6=56. #### 56"

Counts never go negative. Train and test splits are disjoint by construction: a problem belongs to the
test split exactly when a hash of its question text falls in a fixed bucket, so the assignment does not
depend on the seed or the split sizes. ``format_target`` also writes answer-only and one-slip targets for
supervised warm starts. CLI: ``python -m areal_jax.data.synthetic_math --out DIR --n_train N --n_test M``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
from typing import Sequence

from areal_jax.data import math_words
from areal_jax.data.math_tokenizer import build_math_tokenizer

__all__ = ["Difficulty", "DIFFICULTIES", "MathProblem", "generate_problem", "format_target",
           "generate_split", "write_splits", "is_test_problem", "build_math_tokenizer", "TARGET_STYLES"]

TARGET_STYLES = ("worked", "answer_only", "slip")
# Share of the hash space (out of 1000) whose problems go to the test split.
_TEST_BUCKETS = 200


@dataclasses.dataclass(frozen=True)
class Difficulty:
    """The difficulty knob: number of steps, start value range and operand range (inclusive)."""
    min_steps: int = 2
    max_steps: int = 3
    start_min: int = 10
    start_max: int = 99
    operand_min: int = 1
    operand_max: int = 9

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"Need 1 <= min_steps <= max_steps, got {self.min_steps} and {self.max_steps}.")
        if not 0 <= self.start_min <= self.start_max:
            raise ValueError(f"Need 0 <= start_min <= start_max, got {self.start_min} and {self.start_max}.")
        if not 1 <= self.operand_min <= self.operand_max:
            raise ValueError(f"Need 1 <= operand_min <= operand_max, got {self.operand_min} and "
                             f"{self.operand_max}.")


DIFFICULTIES: dict[str, Difficulty] = {
    "easy": Difficulty(),
    "medium": Difficulty(min_steps=3, max_steps=4),
    "hard": Difficulty(min_steps=2, max_steps=4, operand_min=10, operand_max=99),
}


def _as_difficulty(difficulty: Difficulty | str) -> Difficulty:
    if isinstance(difficulty, Difficulty):
        return difficulty
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"Unknown difficulty {difficulty!r}; use one of {sorted(DIFFICULTIES)} or a "
                         f"Difficulty(...).")
    return DIFFICULTIES[difficulty]


@dataclasses.dataclass(frozen=True)
class MathProblem:
    """One word problem: a start count and (op, operand) steps, op in {"+", "-"}."""
    name: str
    obj: str
    start: int
    steps: tuple[tuple[str, int, str], ...]  # (op, operand, verb phrase)

    @property
    def values(self) -> list[int]:
        """The running count: [start, after step 1, ..., after the last step]."""
        out = [self.start]
        for op, operand, _ in self.steps:
            out.append(out[-1] + operand if op == "+" else out[-1] - operand)
        return out

    @property
    def answer(self) -> int:
        return self.values[-1]

    @property
    def question(self) -> str:
        sentences = [f"{self.name} has {self.start} {self.obj}."]
        for i, (op, operand, verb) in enumerate(self.steps):
            lead = self.name if i == 0 else f"Then {self.name}"
            more = " more" if op == "+" else ""
            sentences.append(f"{lead} {verb} {operand}{more}.")
        sentences.append(f"How many {self.obj} does {self.name} have now?")
        return " ".join(sentences)

    @property
    def solution(self) -> str:
        """The worked solution, e.g. "57+5=62. 62-6=56. #### 56"."""
        return format_target(self, "worked")

    def to_json(self) -> dict[str, str]:
        """The GSM8K layout: {"question": ..., "answer": "<worked solution> #### <int>"}."""
        return {"question": self.question, "answer": self.solution}


def generate_problem(rng: random.Random, difficulty: Difficulty | str = "easy") -> MathProblem:
    """Draws one problem. Subtractions never take the count below zero (an addition is used instead)."""
    d = _as_difficulty(difficulty)
    value = rng.randint(d.start_min, d.start_max)
    start = value
    steps = []
    for _ in range(rng.randint(d.min_steps, d.max_steps)):
        can_subtract = value >= d.operand_min
        if can_subtract and rng.random() < 0.5:
            operand = rng.randint(d.operand_min, min(d.operand_max, value))
            steps.append(("-", operand, rng.choice(math_words.SUB_VERBS)))
            value -= operand
        else:
            operand = rng.randint(d.operand_min, d.operand_max)
            steps.append(("+", operand, rng.choice(math_words.ADD_VERBS)))
            value += operand
    return MathProblem(name=rng.choice(math_words.NAMES), obj=rng.choice(math_words.OBJECTS),
                       start=start, steps=tuple(steps))


def _worked(start: int, steps: Sequence[tuple[str, int, str]], slip_at: int | None = None,
            slip_delta: int = 0) -> tuple[str, int]:
    parts = []
    value = start
    for i, (op, operand, _) in enumerate(steps):
        result = value + operand if op == "+" else value - operand
        if i == slip_at:
            result += slip_delta
        parts.append(f"{value}{op}{operand}={result}.")
        value = result
    parts.append(f"{math_words.ANSWER_MARK} {value}")
    return " ".join(parts), value


def format_target(problem: MathProblem, style: str = "worked", rng: random.Random | None = None) -> str:
    """The supervised target text for ``problem``, joined to the prompt ("...Answer:") by one space.

    Styles:
      "worked": every step then the answer, "57+5=62. 62-6=56. #### 56".
      "answer_only": "#### 56".
      "slip": a worked solution where exactly one step's result is off by 1-3; later steps are computed
        correctly from the wrong value, so the final answer is wrong and every count stays >= 0.
        The slip is drawn from ``rng`` (default: seeded by the question, so it is reproducible).
    """
    if style == "worked":
        return _worked(problem.start, problem.steps)[0]
    if style == "answer_only":
        return f"{math_words.ANSWER_MARK} {problem.answer}"
    if style != "slip":
        raise ValueError(f"Unknown target style {style!r}; use one of {TARGET_STYLES}.")
    if rng is None:
        rng = random.Random(_question_hash(problem.question))
    slip_at = rng.randrange(len(problem.steps))
    values = problem.values
    # A negative slip is allowed only if no later count (nor the slipped result) would drop below zero.
    lowest_after = min(values[slip_at + 1:])
    deltas = [d for d in (-3, -2, -1, 1, 2, 3) if d > 0 or lowest_after + d >= 0]
    return _worked(problem.start, problem.steps, slip_at, rng.choice(deltas))[0]


def _question_hash(question: str) -> int:
    return int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "big")


def is_test_problem(question: str) -> bool:
    """Whether a question belongs to the test split (a fixed 20% of the hash space)."""
    return _question_hash(question) % 1000 < _TEST_BUCKETS


def generate_split(split: str, n: int, seed: int, difficulty: Difficulty | str = "easy") -> list[MathProblem]:
    """``n`` distinct problems of ``split`` ("train" or "test"), drawn with ``seed``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    if n < 0:
        raise ValueError(f"The number of problems must be >= 0, got {n}.")
    rng = random.Random(f"synthetic_math/{split}/{seed}")
    want_test = split == "test"
    seen: set[str] = set()
    out: list[MathProblem] = []
    attempts, max_attempts = 0, 100 * n + 1000
    while len(out) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(f"Could only draw {len(out)} distinct {split} problems of {n} requested at "
                             f"difficulty {difficulty!r}; ask for fewer or widen the ranges.")
        problem = generate_problem(rng, difficulty)
        question = problem.question
        if is_test_problem(question) != want_test or question in seen:
            continue
        seen.add(question)
        out.append(problem)
    return out


def write_splits(out_dir: str, n_train: int, n_test: int, seed: int = 0,
                 difficulty: Difficulty | str = "easy") -> dict[str, str]:
    """Writes ``out_dir``/train.jsonl and test.jsonl; returns {"train": path, "test": path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("test", n_test)):
        path = os.path.join(out_dir, f"{split}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for problem in generate_split(split, n, seed, difficulty):
                f.write(json.dumps(problem.to_json()) + "\n")
        paths[split] = path
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write synthetic arithmetic word problems as "
                                                 "train.jsonl / test.jsonl (GSM8K layout).")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--n_train", type=int, default=10000)
    parser.add_argument("--n_test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", default="easy", choices=sorted(DIFFICULTIES))
    args = parser.parse_args(argv)
    paths = write_splits(args.out, args.n_train, args.n_test, args.seed, args.difficulty)
    print(f"wrote {args.n_train} problems to {paths['train']} and {args.n_test} to {paths['test']}")


if __name__ == "__main__":
    main()
