"""Special judges (rewards/code_checker.py): a task's checker decides its stdin cases in both runners, sees exactly the
three files of its contract, and its failures (crash, hang, wrong exit) cost the case, never the reward call; the
Codeforces reader attaches a row's generated_checker, and repair-turn feedback is judged by it too."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from areal_jax.data.code_readers import read_code_jsonl
from areal_jax.rewards.code import code_tests_reward, run_tests
from areal_jax.rewards.code_checker import checker_program, checker_stdin
from areal_jax.rewards.code_feedback import code_feedback
from areal_jax.rewards.code_tests import TestSpec as Spec
from areal_jax.rewards.code_tests import encode_tests, parse_tests

# "Print two non-negative integers that sum to n": many right answers; the reference prints "0 n".
SUM_CHECKER = """
import sys
n = int(open(sys.argv[1]).read())
reference = open(sys.argv[2]).read().split()
got = open(sys.argv[3]).read().split()
ok = len(got) == 2 and all(t.lstrip('-').isdigit() for t in got) and min(map(int, got)) >= 0 \\
    and sum(map(int, got)) == n and sum(map(int, reference)) == n
print('checked')
print(1 if ok else 0)
"""
CASES = tuple((f"{n}\n", f"0 {n}\n") for n in (7, 10, 3))
SPEC = Spec(stdio=CASES, checker=SUM_CHECKER)
PROGRAMS = {  # program -> statuses under the checker (pass_rate), and under plain comparison
    "reference": ("print(0, int(input()))", ("pass",) * 3, ("pass",) * 3),
    "another right answer": ("n = int(input())\nprint(n // 2, n - n // 2)", ("pass",) * 3, ("fail",) * 3),
    "wrong on one case": ("n = int(input())\nprint(1, n - 1 if n != 10 else n)", ("pass", "fail", "pass"),
                          ("fail",) * 3),
    "prints the checker's verdict": ("input()\nprint(1)", ("fail",) * 3, ("fail",) * 3),
    "crashes": ("raise ValueError", ("error",) * 3, ("error",) * 3),
}


@pytest.mark.parametrize("runner", ["fork", "process"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_checker_decides_each_case_in_both_runners(name, runner):
    program, with_checker, plain = PROGRAMS[name]
    assert run_tests(program, SPEC, mode="pass_rate", stdio_runner=runner).statuses == with_checker
    no_checker = Spec(stdio=CASES)
    assert run_tests(program, no_checker, mode="pass_rate", stdio_runner=runner).statuses == plain


def test_all_pass_stops_at_the_first_rejected_case():
    statuses = run_tests(PROGRAMS["wrong on one case"][0], SPEC, mode="all_pass").statuses
    assert statuses == ("pass", "fail", "not_run")
    answer = encode_tests(SPEC)
    assert code_tests_reward("```python\nn = int(input())\nprint(n, 0)\n```", answer) == 1.0
    assert code_tests_reward("```python\nprint(5, 5)\n```", answer) == 0.0
    assert code_tests_reward("```python\nn = int(input())\nprint(1, n - 1 if n != 10 else n)\n```", answer,
                             mode="pass_rate") == pytest.approx(2 / 3)


def test_the_checker_sees_its_contract_the_same_as_a_plain_interpreter():
    """The reference: the checker run by a plain interpreter in a directory holding the three files, with that argv."""
    spy = ("import os, sys\nprint(sys.argv[1:])\nprint(sorted(f for f in os.listdir('.') if f.endswith('.txt')))\n"
           "for name in sys.argv[1:]:\n    print(repr(open(name).read()))\nprint(repr(sys.stdin.read()))\nprint(1)")
    stdin, expected, actual = "3 4\n", "7\n", "  7 \n\n"
    sandboxed = run_tests("print('  7 \\n')", Spec(stdio=((stdin, expected),), checker=spy), mode="pass_rate")
    assert sandboxed.statuses == ("pass",)
    from areal_jax.rewards.zygote import run_forked

    inside = run_forked(checker_program(spy), stdin=checker_stdin(stdin, expected, actual), timeout_s=10)
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for name, text in zip(("input.txt", "correct_output.txt", "solution_output.txt"), (stdin, expected, actual)):
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        with open(os.path.join(d, "input.txt")) as f:
            plain = subprocess.run([sys.executable, "-c", spy, "input.txt", "correct_output.txt", "solution_output.txt"],
                                   stdin=f, cwd=d, capture_output=True, text=True, timeout=30)
    assert inside.status == "ok" and plain.returncode == 0
    assert inside.stdout == plain.stdout


@pytest.mark.parametrize("runner", ["fork", "process"])
def test_a_failing_checker_rejects_the_case_and_costs_only_it(runner):
    checkers = {
        "crashes": "raise RuntimeError('checker bug')",
        "exits 1 after printing 1": "import sys\nprint(1)\nsys.exit(1)",
        "prints nothing": "pass",
        "last token is not 1": "print(1)\nprint('ok')",
        "hangs": "while True:\n    pass",
    }
    program = "print(0, int(input()))"
    for name, checker in checkers.items():  # a hanging checker is killed at the case limit (1 s), each case
        out = run_tests(program, Spec(stdio=CASES[:2], checker=checker), mode="pass_rate", case_timeout_s=1.0,
                        sample_timeout_s=10.0, stdio_runner=runner)
        assert out.statuses == ("fail", "fail"), name


def test_the_checker_travels_with_the_tests_and_needs_stdin_cases():
    assert parse_tests(encode_tests(SPEC)) == SPEC
    assert "checker" not in json.loads(encode_tests(Spec(stdio=CASES)))
    with pytest.raises(ValueError, match="stdin/stdout"):
        Spec(calls=(("f(1)", 1),), checker=SUM_CHECKER)


def _codeforces_row(**overrides):
    row = {"id": "1A", "title": "Split", "description": "Given n, print two non-negative integers summing to n.",
           "input_format": "One integer n.", "output_format": "Two integers.",
           "examples": [{"input": "7\n", "output": "0 7\n"}], "note": "Any split is accepted.",
           "time_limit": 1.0, "memory_limit": 256.0, "input_mode": "stdio", "interaction_format": None,
           "official_tests": [{"input": i, "output": o} for i, o in CASES], "generated_checker": SUM_CHECKER}
    row.update(overrides)
    return row


def test_a_codeforces_row_reads_with_its_checker_and_bad_rows_say_why(tmp_path):
    path = tmp_path / "cf.jsonl"
    rows = [_codeforces_row(), _codeforces_row(generated_checker=None),
            _codeforces_row(official_tests=json.dumps([{"input": "4\n", "output": "0 4\n"}]))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, _ = read_code_jsonl(str(path))
    question = records[0].question
    for part in ("Split", "Given n", "Input\nOne integer n.", "Output\nTwo integers.", "Example input\n7",
                 "Example output\n0 7", "Note\nAny split"):
        assert part in question, part
    spec = parse_tests(records[0].answer)
    assert spec.checker == SUM_CHECKER and spec.stdio == CASES and spec.time_limit_s == 1.0
    assert not parse_tests(records[1].answer).checker
    halves = "```python\nn = int(input())\nprint(n // 2, n - n // 2)\n```"
    assert [code_tests_reward(halves, r.answer) for r in records] == [1.0, 0.0, 1.0]
    for bad, message in [(dict(interaction_format="Interact with the jury."), "interactive"),
                         (dict(input_mode="file"), "files"), (dict(official_tests=[]), "no test case"),
                         (dict(generated_checker="def f(:\n"), "does not compile")]:
        path.write_text(json.dumps(_codeforces_row(**bad)) + "\n")
        with pytest.raises(ValueError, match=message) as err:
            read_code_jsonl(str(path))
        assert "line 1" in str(err.value)


def test_a_checker_field_works_on_other_stdin_layouts_too(tmp_path):
    path = tmp_path / "apps.jsonl"
    row = {"question": "Split n.", "checker": SUM_CHECKER,
           "input_output": json.dumps({"inputs": [i for i, _ in CASES], "outputs": [o for _, o in CASES]})}
    path.write_text(json.dumps(row) + "\n")
    records, _ = read_code_jsonl(str(path))
    assert code_tests_reward("```python\nn = int(input())\nprint(n, 0)\n```", records[0].answer) == 1.0


def test_repair_feedback_follows_the_checker():
    answer = encode_tests(SPEC)
    assert code_feedback("```python\nn = int(input())\nprint(n - 1, 1)\n```", answer) == (True, "")
    passed, text = code_feedback("```python\nn = int(input())\nprint(n, 1)\n```", answer)
    assert not passed and "not a right answer" in text and "0 7" in text and "7 1" in text
