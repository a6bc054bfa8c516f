"""Codeforces rows (the open-r1/codeforces layout) and special checkers on any stdin task.

A Codeforces row holds ``official_tests`` (a list of {"input", "output"}, a JSON string or a list), the statement in
parts (``title``, ``description``, ``input_format``, ``output_format``, ``examples``, ``note``), ``time_limit`` in
seconds, ``input_mode`` ("stdio" or "file") and ``interaction_format`` (set for interactive problems). Problems that
read files or talk to an interactor cannot be judged by stdin / stdout tests: such a row is a bad row that says so.
A row's ``generated_checker`` (Codeforces) or ``checker`` (any stdin layout) is the task's special judge
(``rewards.code_checker``); one that does not compile is a bad row.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from areal_jax.data.readers import _BadRow
from areal_jax.rewards.code_tests import TestSpec

__all__ = ["is_codeforces_row", "codeforces_spec", "codeforces_statement", "with_checker", "CHECKER_FIELDS"]

CHECKER_FIELDS = ("generated_checker", "checker")


def is_codeforces_row(row: dict) -> bool:
    return row.get("official_tests") is not None


def _cases(row: dict) -> list:
    tests = row["official_tests"]
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise _BadRow(f"'official_tests' is not valid JSON ({e.msg})") from None
    if not isinstance(tests, list):
        raise _BadRow(f"'official_tests' must be a list of {{'input', 'output'}} objects, got {type(tests).__name__}")
    return tests


def codeforces_spec(row: dict) -> TestSpec:
    """The row's official tests as stdin/stdout cases (its checker is added by ``with_checker``)."""
    interaction = row.get("interaction_format")
    if isinstance(interaction, str) and interaction.strip():
        raise _BadRow("an interactive problem (it has an 'interaction_format'): its program talks to an interactor, "
                      "which stdin/stdout tests cannot play")
    mode = row.get("input_mode")
    if mode not in (None, "", "stdio"):
        raise _BadRow(f"input_mode={mode!r}: the program reads and writes files, and only stdin/stdout is tested")
    cases = []
    for k, case in enumerate(_cases(row)):
        if not (isinstance(case, dict) and isinstance(case.get("input"), str) and isinstance(case.get("output"), str)):
            raise _BadRow(f"official test {k} must be an object with string 'input' and 'output'")
        cases.append((case["input"], case["output"]))
    if not cases:
        raise _BadRow("'official_tests' holds no test case")
    return TestSpec(stdio=tuple(cases))


def codeforces_statement(row: dict) -> str:
    """The statement as a contest shows it: title, legend, input and output formats, the examples and the note."""
    def text(field: str) -> str:
        value = row.get(field)
        return value.strip() if isinstance(value, str) else ""

    parts = [text("title"), text("description")]
    for heading, field in (("Input", "input_format"), ("Output", "output_format")):
        if text(field):
            parts.append(f"{heading}\n{text(field)}")
    examples = row.get("examples")
    for example in examples if isinstance(examples, list) else []:
        if isinstance(example, dict) and isinstance(example.get("input"), str) and isinstance(example.get("output"), str):
            parts.append(f"Example input\n{example['input'].rstrip()}\nExample output\n{example['output'].rstrip()}")
    if text("note"):
        parts.append(f"Note\n{text('note')}")
    return "\n\n".join(p for p in parts if p)


def with_checker(spec: TestSpec, row: dict) -> TestSpec:
    """``spec`` with the row's checker (CHECKER_FIELDS), if it has one; a checker that does not compile, or one on a
    task without stdin cases, is a bad row."""
    field = next((f for f in CHECKER_FIELDS if isinstance(row.get(f), str) and row[f].strip()), None)
    if field is None:
        return spec
    source: Any = row[field]
    try:
        compile(source, "checker.py", "exec")
    except (SyntaxError, ValueError) as e:
        raise _BadRow(f"the checker in {field!r} does not compile ({getattr(e, 'msg', e)}, line "
                      f"{getattr(e, 'lineno', '?')})") from None
    if not spec.stdio:
        raise _BadRow(f"{field!r} holds a checker, which judges stdin/stdout cases, but the row's tests have none")
    return dataclasses.replace(spec, checker=source)
