"""Execution feedback for multi-turn code rollouts: what a program does on a task's first (visible) test cases, as
the text a model reads before its next attempt (a task with a checker has its outputs judged by it).

    passed, text = code_feedback(completion, answer, cases=1)

Each shown case runs the program alone in the sandbox (a run forked from this thread's zygote, with no processes of
its own): a stdin case with its input, a call case followed by ``print(repr(<call>))``, an opaque test program after
the solution. The first case that fails says how, in a few lines ("On the input ... the expected output is ...
but your program printed ...", the call's value against the expected one, the last lines of the error); passed is
True when every shown case passes (text ""). Feedback is advice, not the reward: the reward still runs every hidden
case in the test harnesses (``rewards.code``), whatever the program printed here. The texts are cut to a few hundred
characters each so a feedback turn stays short.
"""
from __future__ import annotations

import ast
import re
from typing import Any

from areal_jax.rewards.code import extract_program
from areal_jax.rewards.code_checker import checker_accepts, checker_program, checker_stdin
from areal_jax.rewards.code_tests import _jsonable, outputs_match, parse_tests, values_equal
from areal_jax.rewards.zygote import run_forked

__all__ = ["code_feedback", "NO_PROGRAM"]

NO_PROGRAM = "No ```python code block was found in your answer. Give the whole program in one ```python block."
_FIELD_CHARS = 300
# Call and test cases load the program as the reward's harness does, as a module (its main block does not run).
_AS_MODULE = "__name__ = 'solution'\n"


def _cut(text: str, limit: int = _FIELD_CHARS) -> str:
    text = text.rstrip("\n")
    return text if len(text) <= limit else text[:limit] + " ..."


_FRAME = re.compile(r'File "main\.py", line (\d+)(?:, in (\S+))?')


def _error_tail(stderr: str, first_line: int, last_line: int) -> str:
    """The error's last line, and where in the program it happened: the innermost frame of main.py whose line lies
    within the program (lines ``first_line`` .. ``last_line`` of what ran), not the sandbox's own frames."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    where = [int(m.group(1)) for m in _FRAME.finditer(stderr) if m.group(2) != "exec_as_main"]
    inside = [n for n in where if first_line <= n <= last_line]
    at = f" (line {inside[-1] - first_line + 1} of your program)" if inside else ""
    return _cut(lines[-1], _FIELD_CHARS) + at


def _failure(result: Any, timeout_s: float, what: str, lines: tuple[int, int]) -> str | None:
    """How a run that did not end normally failed, or None when it did; ``lines``: where the program lies in what
    ran (first, last line)."""
    if result.status == "timeout":
        return f"{what}\nyour program ran past the {timeout_s:g} s time limit."
    if result.status == "output_limit":
        return f"{what}\nyour program printed more than the output limit."
    if result.status != "ok":
        return f"{what}\nyour program failed: {_error_tail(result.stderr, *lines)}"
    return None


def code_feedback(completion: str, answer: str, *, cases: int = 1, case_timeout_s: float = 4.0, memory_mb: int = 512,
                  allow_numpy: bool = False) -> tuple[bool, str]:
    """(passed, text) for ``completion``'s last ```python block on the first ``cases`` cases of ``answer`` (tests JSON:
    stdin cases first, then call cases, then test programs, as ``run_tests`` orders them); see the module doc."""
    spec = parse_tests(answer)
    program = extract_program(completion)
    if program is None:
        return False, NO_PROGRAM
    source = f"{spec.setup}\n{program}" if spec.setup else program
    first = len((spec.setup + "\n").splitlines()) + 1 if spec.setup else 1
    lines = (first, first + len(program.splitlines()) - 1)
    module_lines = (lines[0] + 1, lines[1] + 1)  # after _AS_MODULE's line
    shown = [("stdio", case) for case in spec.stdio] + [("call", case) for case in spec.calls]
    shown = (shown + [("program", case) for case in spec.programs])[:max(1, int(cases))]
    run = {"timeout_s": case_timeout_s, "memory_mb": memory_mb, "allow_numpy": allow_numpy, "allow_subprocess": False}
    for kind, case in shown:
        if kind == "stdio":
            stdin, expected = case
            result = run_forked(source, stdin=stdin, **run)
            where = f"On the input\n{_cut(stdin)}"
            failed = _failure(result, case_timeout_s, where, lines)
            if failed is None and spec.checker:
                verdict = run_forked(checker_program(spec.checker), stdin=checker_stdin(stdin, expected, result.stdout),
                                     **run)
                if not checker_accepts(verdict.status, verdict.stdout):
                    failed = (f"{where}\nyour program printed\n{_cut(result.stdout) or '(nothing)'}\nwhich is not a "
                              f"right answer; one right answer is\n{_cut(expected)}")
            elif failed is None and not outputs_match(result.stdout, expected, spec.output_match):
                failed = (f"{where}\nthe expected output is\n{_cut(expected)}\nbut your program printed\n"
                          f"{_cut(result.stdout) or '(nothing)'}")
        elif kind == "call":
            call, expected = case
            result = run_forked(f"{_AS_MODULE}{source}\n\nprint(repr({call}))", **run)
            failed = _failure(result, case_timeout_s, f"Calling {_cut(call, 120)}", module_lines)
            if failed is None:
                got = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
                if not _repr_equals(got, expected):
                    failed = (f"{_cut(call, 120)} returned {_cut(got, 200) or '(nothing)'}, expected "
                              f"{_cut(repr(expected), 200)}.")
        else:
            result = run_forked(f"{_AS_MODULE}{source}\n\n{case}", **run)
            failed = _failure(result, case_timeout_s, f"On the test\n{_cut(case)}", module_lines)
        if failed is not None:
            return False, failed
    return True, ""


def _repr_equals(text: str, expected: Any) -> bool:
    """Whether the printed repr ``text`` is a literal equal to ``expected`` (floats within the reward's tolerance)."""
    try:
        value = ast.literal_eval(text)
        _jsonable(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return values_equal(value, expected)
