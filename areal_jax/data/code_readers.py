"""Reading programming tasks with hidden tests from JSONL and Parquet files.

Each row becomes a :class:`readers.Record` whose ``question`` is the problem statement shown to the
model and whose ``answer`` is the tests as code_tests JSON (``rewards.code_tests.encode_tests``): the
tests reach the reward function, never the prompt. Layouts, recognised per row:

  * stdin/stdout (APPS, TACO, DeepCoder): ``input_output`` (a JSON string or object) holding ``inputs``
    and ``outputs`` lists; each item a string or a list of lines. With ``fn_name`` it is call-based:
    each input is the list of arguments and each output the return value.
  * assert lists (MBPP): ``test_list`` (assert statements), optional ``test_setup_code``.
  * a test program (HumanEval): ``test`` (defining ``check(candidate)``) plus ``entry_point``.

The statement comes from ``question_field`` ("auto": the first of question, problem, prompt, text,
description). When the tests call a function whose name the statement never mentions, one sentence
naming it is appended. A malformed row (missing tests, unparsable JSON, empty or mismatched cases)
raises a ValueError naming the file and row, or is skipped and counted with ``on_bad_row="skip"``.
"""
from __future__ import annotations

import ast
import json
import os
import re
from typing import Any, Iterator, Sequence

from areal_jax.data.readers import ReadStats, Record, _BadRow, _check_on_bad_row, jsonl_rows
from areal_jax.rewards.code_tests import TestSpec, asserts_to_spec, encode_tests

__all__ = ["read_code_jsonl", "read_code_parquet", "read_code_records", "code_row_to_record",
           "CODE_TASK_OPTIONS", "QUESTION_FIELDS"]

QUESTION_FIELDS = ("question", "problem", "prompt", "text", "description")
# load_prompt_source / load_eval_split options for the synthetic code tasks (data/code_synthetic.py).
CODE_TASK_OPTIONS = {"task": "code", "question_field": "text"}


def _parse_json_field(row: dict, field: str) -> Any:
    value = row[field]
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise _BadRow(f"field {field!r} is not valid JSON ({e.msg} at column {e.colno})") from None
    return value


def _as_text(item: Any, what: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, list) and all(isinstance(x, str) for x in item):
        return "\n".join(item) + ("\n" if item else "")
    raise _BadRow(f"{what} must be a string or a list of lines, got {type(item).__name__}")


def _io_spec(row: dict) -> TestSpec:
    io = _parse_json_field(row, "input_output")
    if not isinstance(io, dict):
        raise _BadRow(f"'input_output' must be an object with 'inputs' and 'outputs', got {type(io).__name__}")
    inputs, outputs = io.get("inputs"), io.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise _BadRow("'input_output' needs 'inputs' and 'outputs' lists")
    if len(inputs) != len(outputs):
        raise _BadRow(f"'input_output' has {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise _BadRow("'input_output' holds no test case")
    fn_name = io.get("fn_name", row.get("fn_name"))
    if fn_name is None:
        return TestSpec(stdio=tuple((_as_text(i, "an input"), _as_text(o, "an output"))
                                    for i, o in zip(inputs, outputs)))
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise _BadRow(f"'fn_name' must be a Python identifier, got {fn_name!r:.60}")
    calls = []
    for args, expected in zip(inputs, outputs):
        if not isinstance(args, list):
            raise _BadRow(f"a call-based input must be the list of arguments, got {type(args).__name__}")
        # A top-level function, else a LeetCode-style method of class Solution (TACO's call-based rows).
        calls.append((f"(globals().get({fn_name!r}) or Solution().{fn_name})(*{args!r})", expected))
    return TestSpec(calls=tuple(calls))


def _called_names(spec: TestSpec) -> set[str]:
    names = set()
    for src in [c for c, _ in spec.calls] + list(spec.programs):
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        names |= {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return names - {"set", "frozenset", "tuple", "list", "sorted", "bool", "check", "isinstance", "abs", "len",
                    "round", "str", "int", "float"}


def _spec_for_row(row: dict) -> tuple[TestSpec, str | None]:
    """The row's tests and the function name the solution must define (None for stdin programs)."""
    if "input_output" in row and row["input_output"] is not None:
        spec = _io_spec(row)
        fn_name = row.get("fn_name") or _parse_json_field(row, "input_output").get("fn_name")
        return spec, fn_name if spec.calls else None
    if "test_list" in row and row["test_list"] is not None:
        tests = _parse_json_field(row, "test_list") if isinstance(row["test_list"], str) else row["test_list"]
        if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
            raise _BadRow("'test_list' must be a list of assert statements")
        if not tests:
            raise _BadRow("'test_list' is empty")
        setup = row.get("test_setup_code") or ""
        try:
            spec = asserts_to_spec(list(tests), setup=setup if isinstance(setup, str) else "")
        except ValueError as e:
            raise _BadRow(str(e)) from None
        names = sorted(_called_names(spec))
        return spec, names[0] if len(names) == 1 else None
    if row.get("test") is not None and row.get("entry_point") is not None:
        test, entry = row["test"], row["entry_point"]
        if not isinstance(test, str) or not test.strip():
            raise _BadRow("'test' must be a non-empty test program")
        if not isinstance(entry, str) or not entry.isidentifier():
            raise _BadRow(f"'entry_point' must be a Python identifier, got {entry!r:.60}")
        try:
            return asserts_to_spec(test, entry_point=entry), entry
        except ValueError as e:
            raise _BadRow(str(e)) from None
    raise _BadRow("no tests: expected 'input_output' (APPS / TACO / DeepCoder), 'test_list' (MBPP) or "
                  "'test' with 'entry_point' (HumanEval)")


def code_row_to_record(path: str, number: int, row: Any, question_field: str = "auto") -> Record:
    """One row as a Record (question: statement, answer: tests JSON); raises _BadRow when malformed."""
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {type(row).__name__}")
    fields = QUESTION_FIELDS if question_field == "auto" else (question_field,)
    field = next((f for f in fields if isinstance(row.get(f), str) and row[f].strip()), None)
    if field is None:
        raise _BadRow(f"no problem statement: field {' / '.join(map(repr, fields))} is missing or empty; pass "
                      f"--config.data.question_field=... to name it")
    spec, name = _spec_for_row(row)
    question = row[field]
    if name is not None and not re.search(rf"\b{re.escape(name)}\b", question):
        question = f"{question.rstrip()}\nWrite it as a Python function named {name}."
    return Record(source=path, row=number, question=question, answer=encode_tests(spec))


def _collect(rows: Iterator[tuple[int, Any]], path: str, where: str, question_field: str, on_bad_row: str,
             stats: ReadStats) -> list[Record]:
    records = []
    for number, row in rows:
        try:
            if isinstance(row, _BadRow):
                raise row
            records.append(code_row_to_record(path, number, row, question_field))
        except _BadRow as err:
            message = f"{path}, {where} {number}: {err}."
            if on_bad_row == "error":
                raise ValueError(message + " Fix the row, or pass --config.data.on_bad_row=skip to skip such "
                                 "rows.") from None
            stats.add_bad(message)
    stats.rows_kept += len(records)
    return records


def read_code_jsonl(path: str, *, question_field: str = "auto", on_bad_row: str = "error",
                    stats: ReadStats | None = None) -> tuple[list[Record], ReadStats]:
    """Reads a JSONL file of tasks; rows are numbered by their 1-based line."""
    _check_on_bad_row(on_bad_row)
    stats = ReadStats() if stats is None else stats

    return _collect(jsonl_rows(path), path, "line", question_field, on_bad_row, stats), stats


def read_code_parquet(path: str, *, question_field: str = "auto", on_bad_row: str = "error",
                      stats: ReadStats | None = None) -> tuple[list[Record], ReadStats]:
    """Reads a Parquet file of tasks; rows are numbered by their 0-based index."""
    import pyarrow.parquet as pq

    _check_on_bad_row(on_bad_row)
    stats = ReadStats() if stats is None else stats
    rows = enumerate(pq.read_table(path).to_pylist())
    return _collect(rows, path, "row index", question_field, on_bad_row, stats), stats


def read_code_records(paths: str | Sequence[str], *, question_field: str = "auto",
                      on_bad_row: str = "error") -> tuple[list[Record], ReadStats]:
    """Reads one or more .jsonl / .parquet task files in order; an empty result is a ValueError."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("No data files given; pass a .jsonl or .parquet path.")
    stats, records = ReadStats(), []
    for path in map(str, paths):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Data file {path!r} does not exist.")
        if path.endswith(".parquet"):
            reader = read_code_parquet
        elif path.endswith(".jsonl"):
            reader = read_code_jsonl
        else:
            raise ValueError(f"Cannot tell the format of {path!r}: name it *.jsonl or *.parquet.")
        records += reader(path, question_field=question_field, on_bad_row=on_bad_row, stats=stats)[0]
    if not records:
        skipped = f" ({stats.bad_rows_skipped} malformed rows skipped)" if stats.bad_rows_skipped else ""
        raise ValueError(f"The code dataset {paths} has no usable rows{skipped}; check the files and the test "
                         "fields (input_output, test_list, or test + entry_point).")
    return records, stats
