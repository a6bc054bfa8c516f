"""Reading programming tasks with hidden tests from JSONL and Parquet files.

Each row becomes a :class:`readers.Record` whose ``question`` is the problem statement shown to the
model and whose ``answer`` is the tests as code_tests JSON (``rewards.code_tests.encode_tests``): the
tests reach the reward function, never the prompt. Layouts, recognised per row:

  * stdin/stdout (APPS, TACO, DeepCoder): ``input_output`` (a JSON string or object) holding ``inputs``
    and ``outputs`` lists; each item a string or a list of lines. With ``fn_name`` it is call-based:
    each input is the list of arguments and each output the return value.
  * CodeContests: ``public_tests``, ``private_tests`` and ``generated_tests``, each {"input": [...], "output": [...]}
    (a JSON string or an object), all run as stdin/stdout cases; the statement is ``description``. Outputs
    are compared as the reward's ``code_output_match`` says (by default tokens, real numbers within 1e-6, which
    covers the contests' real-valued answers); problems that accept several different right outputs (a special
    checker in the contest) are not told apart: only the listed output passes, unless the row has a ``checker``.
  * Codeforces (open-r1/codeforces): ``official_tests``, a list of {"input", "output"}, with the problem's
    ``generated_checker`` as its special judge where it has one (``data/codeforces.py``); the statement is
    ``prompt``, else assembled from ``title``, ``description``, ``input_format``, ``output_format``, ``examples``
    and ``note``. Interactive problems and problems that read files are bad rows.
  Any stdin layout may carry a special judge in ``checker`` (``rewards.code_checker``: Python source run as
  ``checker.py input.txt correct_output.txt solution_output.txt``, accepting with a last printed token ``1``).
  * assert lists (MBPP): ``test_list`` (assert statements), optional ``test_setup_code``.
  * a test program (HumanEval): ``test`` (defining ``check(candidate)``) plus ``entry_point``.
  * a case list (DeepCoder ``tests``, LiveCodeBench ``public_test_cases`` / ``private_test_cases``): a
    JSON list of {"input", "output", "testtype": "stdin" | "functional"} (PrimeIntellect rows say
    "type": "stdin_stdout" | "function_call"); functional cases call ``func_name`` from ``metadata`` (or
    the case's ``fn_name``) with one JSON argument per input line and compare the JSON output. A
    DeepCoder ``tests`` object with ``inputs`` / ``outputs`` (its TACO part) reads as ``input_output``.
    LiveCodeBench's compressed private tests (base64 of zlib of a pickled JSON string) are decoded by an
    unpickler that builds plain values only: a pickle naming any class or function (how a pickle runs
    code) is refused as a bad row, and nothing in it is ever called.
    A ``starter_code`` (the class and method signature) is appended to the statement.

Call-based tasks of the APPS / TACO, DeepCoder and LiveCodeBench layouts (LeetCode's) get ``code_tests.CALL_PRELUDE``
as their setup: the names (List, Counter, heappush, gcd, ...) their judges give a solution without its importing them.

A row's own time limit per case is kept with its tests (``TestSpec.time_limit_s``; the reward applies it when
``reward.code_time_limit_factor`` is set): CodeContests' ``time_limit`` ({"seconds", "nanos"}) and TACO's ("2
seconds", "1.5 s", "500 ms"); one that cannot be read ("None", "", nonsense) counts as none.

The statement comes from ``question_field``; "auto" picks per layout (APPS / TACO: question, DeepCoder:
problem, LiveCodeBench: question_content, MBPP: text then prompt, HumanEval: prompt), then the first of
question, problem, prompt, text, description. When the tests call a function whose name the statement
never mentions, one sentence naming it is appended. A malformed row (missing tests, unparsable JSON,
empty or mismatched cases) raises a ValueError naming the file and row, or is skipped and counted with
``on_bad_row="skip"``.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from typing import Any, Iterator, Sequence

from areal_jax.data.codeforces import codeforces_spec, codeforces_statement, is_codeforces_row, with_checker
from areal_jax.data.compressed_tests import decode_compressed_cases
from areal_jax.data.readers import ReadStats, Record, _BadRow, _check_on_bad_row, collect_rows, jsonl_rows, read_each
from areal_jax.rewards.code_tests import CALL_PRELUDE, TestSpec, asserts_to_spec, encode_tests

__all__ = ["read_code_jsonl", "read_code_parquet", "read_code_records", "code_row_to_record",
           "CODE_TASK_OPTIONS", "QUESTION_FIELDS"]

QUESTION_FIELDS = ("question", "problem", "prompt", "text", "description")
# "auto" statement fields per layout, tried before QUESTION_FIELDS; keyed by _spec_for_row's layout.
CONTEST_TEST_FIELDS = ("public_tests", "private_tests", "generated_tests")
LAYOUT_QUESTION_FIELDS = {"input_output": ("question",), "tests": ("problem", "question"), "contests": ("description",),
                          "test_cases": ("question_content",), "test_list": ("text", "prompt"),
                          "test": ("prompt",), "official_tests": ("prompt", "description")}
_BASE64 = re.compile(r"[A-Za-z0-9+/]{16,}={0,2}")
_STDIN_TYPES, _CALL_TYPES = ("stdin", "stdin_stdout"), ("functional", "function_call")
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
        calls.append((_call_source(fn_name, args), expected))
    return TestSpec(calls=tuple(calls))


def _contests_spec(row: dict) -> TestSpec:
    """CodeContests: every case of public_tests, private_tests and generated_tests, in that order, as stdin/stdout."""
    cases = []
    for field in CONTEST_TEST_FIELDS:
        if row.get(field) in (None, "", {}):
            continue
        tests = _parse_json_field(row, field)
        if not isinstance(tests, dict) or not isinstance(tests.get("input"), list) \
                or not isinstance(tests.get("output"), list):
            raise _BadRow(f"{field!r} must be an object with 'input' and 'output' lists")
        if len(tests["input"]) != len(tests["output"]):
            raise _BadRow(f"{field!r} has {len(tests['input'])} inputs but {len(tests['output'])} outputs")
        cases += [(_as_text(i, f"an input of {field!r}"), _as_text(o, f"an output of {field!r}"))
                  for i, o in zip(tests["input"], tests["output"])]
    if not cases:
        raise _BadRow(f"{' / '.join(map(repr, CONTEST_TEST_FIELDS))} hold no test case")
    return TestSpec(stdio=tuple(cases))


def _call_source(fn_name: str, args: list) -> str:
    # A top-level function, else a LeetCode-style method of class Solution (TACO's and LiveCodeBench's rows).
    return f"(globals().get({fn_name!r}) or Solution().{fn_name})(*{args!r})"


def _json_value(text: Any, what: str) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _BadRow(f"{what} {text!r:.60} is not JSON ({e.msg})") from None


def _func_name(row: dict) -> str | None:
    """``func_name`` of the row's ``metadata`` (a JSON string or an object), None when absent."""
    meta = row.get("metadata")
    if isinstance(meta, str) and meta.strip():
        meta = _parse_json_field(row, "metadata")
    return meta.get("func_name") if isinstance(meta, dict) else None


def _case_list_spec(cases: Any, field: str, fn_name: str | None) -> tuple[TestSpec, str | None]:
    """DeepCoder / LiveCodeBench case lists: stdin cases and functional calls (one JSON argument a line);
    also the function's name when every functional case calls the same one."""
    if not isinstance(cases, list):
        raise _BadRow(f"{field!r} must be a list of test cases, got {type(cases).__name__}")
    if not cases:
        raise _BadRow(f"{field!r} holds no test case")
    stdio, calls, names = [], [], set()
    for n, case in enumerate(cases):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise _BadRow(f"case {n} of {field!r} must be an object with 'input' and 'output'")
        kind = case.get("testtype", case.get("type", "functional" if fn_name else "stdin"))
        if kind in _STDIN_TYPES:
            stdio.append((_as_text(case["input"], "an input"), _as_text(case["output"], "an output")))
        elif kind in _CALL_TYPES:
            name = case.get("fn_name") or fn_name
            if not isinstance(name, str) or not name.isidentifier():
                raise _BadRow(f"case {n} of {field!r} is functional but the row names no function (metadata "
                              f"'func_name' or the case's 'fn_name', got {name!r:.60})")
            names.add(name)
            args = case["input"]
            if isinstance(args, str):
                args = [_json_value(line, f"argument line of case {n}") for line in args.split("\n") if line.strip()]
            if not isinstance(args, list):
                raise _BadRow(f"case {n} of {field!r}: the input must be argument lines or a list of arguments")
            calls.append((_call_source(name, args), _json_value(case["output"], f"the output of case {n}")))
        else:
            raise _BadRow(f"case {n} of {field!r} has test type {kind!r:.40}, not stdin or functional")
    return TestSpec(stdio=tuple(stdio), calls=tuple(calls)), names.pop() if len(names) == 1 else None


def _private_cases(value: Any) -> Any:
    """LiveCodeBench's private_test_cases: a JSON list, or its compressed form (``decode_compressed_cases``)."""
    if isinstance(value, str) and _BASE64.fullmatch(value.strip()):
        return decode_compressed_cases(value)
    return _json_value(value, "field 'private_test_cases'")


def _lcb_spec(row: dict) -> tuple[TestSpec, str | None]:
    cases = []
    for field in ("public_test_cases", "private_test_cases"):
        if row.get(field) not in (None, "", []):
            value = _private_cases(row[field]) if field == "private_test_cases" else _parse_json_field(row, field)
            if not isinstance(value, list):
                raise _BadRow(f"{field!r} must be a list of test cases, got {type(value).__name__}")
            cases += value
    return _case_list_spec(cases, "public_test_cases", _func_name(row))


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


def _spec_for_row(row: dict) -> tuple[TestSpec, str | None, str]:
    """The row's tests, the function name the solution must define (None for stdin programs) and the
    layout (a LAYOUT_QUESTION_FIELDS key)."""
    spec, name, layout = _layout_spec(row)
    spec = with_checker(spec, row)
    if spec.calls and layout in ("input_output", "tests", "test_cases"):  # LeetCode-style function tasks
        spec = dataclasses.replace(spec, setup=CALL_PRELUDE + spec.setup)
    if layout == "test_list":
        called = sorted(_called_names(spec))
        name = called[0] if len(called) == 1 else None
    return spec, name, layout


def _layout_spec(row: dict) -> tuple[TestSpec, str | None, str]:
    if "input_output" in row and row["input_output"] is not None:
        spec = _io_spec(row)
        fn_name = row.get("fn_name") or _parse_json_field(row, "input_output").get("fn_name")
        return spec, fn_name if spec.calls else None, "input_output"
    if row.get("tests") is not None:  # DeepCoder
        tests = _parse_json_field(row, "tests")
        if isinstance(tests, dict):  # its TACO part keeps the input_output object
            spec = _io_spec({"input_output": tests, "fn_name": row.get("fn_name")})
            return spec, tests.get("fn_name") if spec.calls else None, "tests"
        return (*_case_list_spec(tests, "tests", _func_name(row)), "tests")
    if row.get("public_test_cases") is not None or row.get("private_test_cases") is not None:
        return (*_lcb_spec(row), "test_cases")
    if is_codeforces_row(row):
        return codeforces_spec(row), None, "official_tests"
    if any(row.get(field) is not None for field in CONTEST_TEST_FIELDS):
        return _contests_spec(row), None, "contests"
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
        return spec, None, "test_list"
    if row.get("test") is not None and row.get("entry_point") is not None:
        test, entry = row["test"], row["entry_point"]
        if not isinstance(test, str) or not test.strip():
            raise _BadRow("'test' must be a non-empty test program")
        if not isinstance(entry, str) or not entry.isidentifier():
            raise _BadRow(f"'entry_point' must be a Python identifier, got {entry!r:.60}")
        try:
            return asserts_to_spec(test, entry_point=entry), entry, "test"
        except ValueError as e:
            raise _BadRow(str(e)) from None
    raise _BadRow("no tests: expected 'input_output' (APPS / TACO), 'tests' (DeepCoder), 'public_test_cases' "
                  "(LiveCodeBench), 'public_tests' / 'private_tests' (CodeContests), 'official_tests' (Codeforces), "
                  "'test_list' (MBPP) or 'test' with 'entry_point' (HumanEval)")


_TIME_LIMIT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|secs|seconds?|ms|milliseconds?)?\s*", re.IGNORECASE)


def time_limit_seconds(value: Any) -> float:
    """A row's ``time_limit`` in seconds: CodeContests' {"seconds", "nanos"}, a number, or TACO's text ("2 seconds",
    "1.5 s", "500 ms"); 0.0 when there is none or it cannot be read."""
    if isinstance(value, dict):
        seconds = value.get("seconds") or 0
        nanos = value.get("nanos") or 0
        total = seconds + nanos / 1e9 if isinstance(seconds, (int, float)) and isinstance(nanos, (int, float)) else 0
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        total = value
    elif isinstance(value, str) and (m := _TIME_LIMIT.fullmatch(value)):
        total = float(m.group(1)) / (1000.0 if (m.group(2) or "").lower().startswith("m") else 1.0)
    else:
        total = 0.0
    return float(total) if math.isfinite(total) and total > 0 else 0.0


def code_row_to_record(path: str, number: int, row: Any, question_field: str = "auto") -> Record:
    """One row as a Record (question: statement, answer: tests JSON); raises _BadRow when malformed."""
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {type(row).__name__}")
    spec, name, layout = _spec_for_row(row)
    if question_field == "auto":
        fields = tuple(dict.fromkeys(LAYOUT_QUESTION_FIELDS[layout] + QUESTION_FIELDS))
    else:
        fields = (question_field,)
    field = next((f for f in fields if isinstance(row.get(f), str) and row[f].strip()), None)
    if field is None:
        texts = [k for k, v in row.items() if isinstance(v, str) and v.strip()]
        raise _BadRow(f"no problem statement: field {' / '.join(map(repr, fields))} is missing or empty (the row's "
                      f"text fields: {', '.join(map(repr, texts)) or 'none'}); pass "
                      f"--config.data.question_field=<one of them>, or auto to pick per layout")
    question = codeforces_statement(row) if layout == "official_tests" and field == "description" else row[field]
    starter = row.get("starter_code")  # LiveCodeBench / DeepCoder: the signature a functional task expects
    if isinstance(starter, str) and starter.strip() and starter.strip() not in question:
        question = f"{question.rstrip()}\n\nStart from:\n```python\n{starter.strip()}\n```"
    if name is not None and not re.search(rf"\b{re.escape(name)}\b", question):
        question = f"{question.rstrip()}\nWrite it as a Python function named {name}."
    limit = time_limit_seconds(row.get("time_limit"))
    if limit:
        spec = dataclasses.replace(spec, time_limit_s=limit)
    return Record(source=path, row=number, question=question, answer=encode_tests(spec))


def _collect(rows: Iterator[tuple[int, Any]], path: str, where: str, question_field: str, on_bad_row: str,
             stats: ReadStats) -> list[Record]:
    return collect_rows(rows, path, where, lambda number, row: code_row_to_record(path, number, row, question_field),
                        on_bad_row, stats)


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
    stats = ReadStats()
    records = read_each(paths, read_code_jsonl, read_code_parquet, stats, question_field=question_field,
                        on_bad_row=on_bad_row)
    if not records:
        skipped = f" ({stats.bad_rows_skipped} malformed rows skipped)" if stats.bad_rows_skipped else ""
        raise ValueError(f"The code dataset {paths} has no usable rows{skipped}; check the files and the test "
                         "fields (input_output, tests, public_test_cases, public_tests, official_tests, test_list, or "
                         "test + entry_point).")
    return records, stats
