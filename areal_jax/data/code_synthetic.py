"""Synthetic programming tasks with hidden assert tests, in the MBPP JSONL layout.

    question:  "Write f(x) that returns the sum of the digits of x, times 3."
    code:      "def f(x):\\n    return sum(int(d) for d in str(x))*3"
    test_list: ["assert f(58) == 39", "assert f(0) == 0", ...]

Every task is a template with one or two small integer constants. Train and test are disjoint by a hash
of the question (20% of the hash space is test), independent of seed and sizes, so test tasks are
held-out (template, constant) combinations. ``format_target`` writes the supervised targets of a warm
start: "correct", "confused" (the program of a look-alike task with the same constants: max for min, //
for %, ... which fails the tests) and "slip" (the correct program with a constant off by one or two).
``repair_target`` writes a two-attempt target: a confused or slipped program, the execution feedback the
rollout's repair turns would show after it (``rewards.code_feedback`` on the first test, wrapped in
``REPAIR_TEMPLATE``), then the correct program.
CLI: ``python -m areal_jax.data.code_synthetic --out DIR --n_train N --n_test M``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import random
from typing import Callable, Sequence

from areal_jax.data.code_tokenizer import build_code_tokenizer

__all__ = ["CodeTask", "TEMPLATES", "TARGET_STYLES", "REPAIR_TEMPLATE", "generate_task", "generate_split",
           "write_splits", "format_target", "repair_target", "is_test_task", "build_tokenizer", "REWARD_FN"]

TARGET_STYLES = ("correct", "confused", "slip")
# What the rollout appends after a failed attempt (rollout.feedback_template of configs/code_repair.py): the
# prompt frame's "\nAnswer:" again, so a repair starts as a first attempt does.
REPAIR_TEMPLATE = "\nFeedback: {feedback}\nAnswer:"
REWARD_FN = "areal_jax.rewards.code:code_all_pass"
_TEST_BUCKETS = 200  # of 1000: the share of the hash space whose tasks are test tasks
_INPUTS = (0, 1, 3, 7, 10, 12, 25, 38, 49, 58, 64, 77, 90, 101, 123, 406, 555, 909, 1234, 4071)


@dataclasses.dataclass(frozen=True)
class _Template:
    name: str
    question: str  # with {a} (and {b})
    body: str  # the expression returned, with {a} / {b}
    confused_with: str  # name of the look-alike template
    two_constants: bool = False


TEMPLATES: dict[str, _Template] = {t.name: t for t in (
    _Template("affine", "returns x times {a} plus {b}", "x*{a}+{b}", "affine_swap", True),
    _Template("affine_swap", "returns x plus {a} times {b}", "x+{a}*{b}", "affine", True),
    _Template("mod", "returns x modulo {a}", "x%{a}", "floordiv"),
    _Template("floordiv", "returns x divided by {a}, rounded down", "x//{a}", "mod"),
    _Template("max", "returns the larger of x and {a}", "max(x,{a})", "min"),
    _Template("min", "returns the smaller of x and {a}", "min(x,{a})", "max"),
    _Template("digit_sum", "returns the sum of the digits of x, times {a}", "sum(int(d) for d in str(x))*{a}",
              "digit_count"),
    _Template("digit_count", "returns the number of digits of x, times {a}", "len(str(x))*{a}", "digit_sum"),
    _Template("count_digit", "returns how many times the digit {a} appears in x", "str(x).count('{a}')",
              "has_digit"),
    _Template("has_digit", "returns True if the digit {a} appears in x", "'{a}' in str(x)", "count_digit"),
    _Template("square_plus", "returns x squared plus {a}", "x*x+{a}", "times_plus"),
    _Template("times_plus", "returns x times x times {a}", "x*x*{a}", "square_plus"),
    _Template("divisible", "returns True if x is divisible by {a}", "x%{a}==0", "mod"),
    _Template("minus", "returns x minus {a}", "x-{a}", "reverse_minus"),
    _Template("reverse_minus", "returns {a} minus x", "{a}-x", "minus"),
)}


@dataclasses.dataclass(frozen=True)
class CodeTask:
    """One task: template name, constants, and the inputs its hidden tests call f with."""
    template: str
    a: int
    b: int
    inputs: tuple[int, ...]

    def _fill(self, text: str) -> str:
        return text.replace("{a}", str(self.a)).replace("{b}", str(self.b))

    @property
    def question(self) -> str:
        return f"Write f(x) that {self._fill(TEMPLATES[self.template].question)}."

    def program(self, template: str | None = None, a: int | None = None, b: int | None = None) -> str:
        """The program of this task (or of another template / constants), as the model writes it."""
        t = TEMPLATES[template or self.template]
        body = t.body.replace("{a}", str(self.a if a is None else a)).replace("{b}", str(self.b if b is None else b))
        return f"def f(x):\n    return {body}"

    @property
    def code(self) -> str:
        return self.program()

    def expected(self, program: str | None = None) -> list:
        """f(x) for every test input, computed by running ``program`` (default: the correct one)."""
        fn = _compiled(program or self.code)
        return [fn(x) for x in self.inputs]

    @property
    def tests(self) -> list[str]:
        return [f"assert f({x}) == {y!r}" for x, y in zip(self.inputs, self.expected())]

    def to_json(self) -> dict:
        """The MBPP layout: text, code, test_list (hidden tests), plus the task's parameters."""
        return {"text": self.question, "code": self.code, "test_list": self.tests,
                "template": self.template, "a": self.a, "b": self.b}


@functools.lru_cache(maxsize=None)
def _compiled(program: str) -> Callable:
    namespace: dict = {}
    exec(program, namespace)  # trusted: generated by this module
    return namespace["f"]


def generate_task(rng: random.Random) -> CodeTask:
    """Draws a template, its constants and 5 test inputs on which the confused program and every
    slipped constant give a different answer from the correct program on at least one input."""
    while True:
        name = rng.choice(sorted(TEMPLATES))
        two = TEMPLATES[name].two_constants
        a = rng.randint(2, 9) if name in ("count_digit", "has_digit") else rng.randint(2, 19 if two else 99)
        b = rng.randint(1, 9) if two else 0
        task = CodeTask(name, a, b, tuple(sorted(rng.sample(_INPUTS, 5))))
        right = task.expected()
        wrong = [task.program(TEMPLATES[name].confused_with)] + [task.program(a=a + d) for d in _slips(a)]
        if all(task.expected(p) != right for p in wrong):
            return task


def _slips(a: int) -> tuple[int, ...]:
    """Offsets of a slipped constant: -2..2 without 0, keeping the constant >= 1."""
    return tuple(d for d in (-2, -1, 1, 2) if a + d >= 1)


def format_target(task: CodeTask, style: str = "correct", rng: random.Random | None = None) -> str:
    """The supervised target: the correct program, a look-alike task's program ("confused") or the
    correct program with its first constant off by 1 or 2, staying >= 1 ("slip"; drawn from rng,
    default seeded by the question)."""
    if style == "correct":
        return task.code
    if style == "confused":
        return task.program(TEMPLATES[task.template].confused_with)
    if style != "slip":
        raise ValueError(f"Unknown target style {style!r}; use one of {TARGET_STYLES}.")
    rng = rng or random.Random(_hash(task.question))
    return task.program(a=task.a + rng.choice(_slips(task.a)))


def repair_target(task: CodeTask, rng: random.Random | None = None) -> tuple[str, str, str] | None:
    """(first attempt, feedback text, repair) of a repair target: a confused program or a slipped one (even odds,
    from rng, default seeded by the question), what ``rewards.code_feedback`` says of it on the task's first test
    (the text a repair turn shows), and the correct program. None when the wrong program passes that test (no
    feedback turn would follow it)."""
    rng = rng or random.Random(_hash(task.question))
    wrong = format_target(task, "confused" if rng.random() < 0.5 else "slip", rng)
    passed, text = _first_test_feedback(wrong, tuple(task.tests))
    return None if passed else (wrong, text, task.code)


@functools.lru_cache(maxsize=65536)
def _first_test_feedback(program: str, tests: tuple[str, ...]) -> tuple[bool, str]:
    from areal_jax.rewards.code_feedback import code_feedback
    from areal_jax.rewards.code_tests import asserts_to_spec, encode_tests

    return code_feedback(program, encode_tests(asserts_to_spec(list(tests))), cases=1)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def is_test_task(question: str) -> bool:
    """Whether a question belongs to the test split (a fixed 20% of the hash space)."""
    return _hash(question) % 1000 < _TEST_BUCKETS


def generate_split(split: str, n: int, seed: int, difficulty: str | None = None) -> list[CodeTask]:
    """``n`` distinct-question tasks of ``split`` ("train" or "test"); difficulty is unused (one level)."""
    del difficulty
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    rng = random.Random(f"code_synthetic/{split}/{seed}")
    seen: set[str] = set()
    out: list[CodeTask] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 1000:
            raise ValueError(f"Could only draw {len(out)} distinct {split} tasks of {n} requested; ask for fewer.")
        task = generate_task(rng)
        if is_test_task(task.question) != (split == "test") or task.question in seen:
            continue
        seen.add(task.question)
        out.append(task)
    return out


def write_splits(out_dir: str, n_train: int, n_test: int, seed: int = 0, difficulty: str | None = None) -> dict:
    """Writes ``out_dir``/train.jsonl and test.jsonl (MBPP layout); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("test", n_test)):
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        with open(paths[split], "w", encoding="utf-8") as f:
            for task in generate_split(split, n, seed, difficulty):
                f.write(json.dumps(task.to_json()) + "\n")
    return paths


def build_tokenizer():
    """The character-level tokenizer the synthetic code tasks are trained with."""
    return build_code_tokenizer()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write synthetic programming tasks as train.jsonl / "
                                                 "test.jsonl (MBPP layout: text, code, test_list).")
    parser.add_argument("--out", required=True)
    parser.add_argument("--n_train", type=int, default=4000)
    parser.add_argument("--n_test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = write_splits(args.out, args.n_train, args.n_test, args.seed)
    print(f"wrote {args.n_train} tasks to {paths['train']} and {args.n_test} to {paths['test']}")


if __name__ == "__main__":
    main()
