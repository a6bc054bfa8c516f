"""Check a code dataset before training on it: do its own reference solutions pass its tests, and do its checkers
accept its listed outputs? Public code sets hold tasks whose tests are wrong (every sample of such a task scores 0:
compute spent on no signal); RL recipes drop them before training.

    python -m areal_jax.programs.check_code_data --data=train.jsonl [--data=more.parquet] --out=clean.jsonl \\
        [--report=report.jsonl] [--exclude=test.jsonl] [--workers=2] [--limit=N]

Each row is read as the code job reads it (``data/code_readers.py``; a malformed row is reported with its file and
line). Its reference solutions, where the layout has them, run against its tests in the sandbox, as the reward runs a
completion (pass rate, ``rewards/code.py``): APPS / TACO ``solutions`` (a JSON list of programs), CodeContests
``solutions`` (its Python 3 ones), MBPP ``code``, HumanEval ``prompt`` + ``canonical_solution`` and a ``solution``
string. The row passes when one of its first ``--max_references`` solutions passes every case. A row with a checker
and no reference is checked the other way: a program that prints each case's listed output must be accepted by the
checker. Rows with neither are kept and counted as unchecked. A row whose reference passes and that lists known-wrong
solutions (CodeContests' ``incorrect_solutions``) runs its first ``--max_incorrect`` Python 3 ones too: if one of them
passes every case, the tests are too weak to tell right from wrong (RL would reward the wrong program) and the row is
dropped. ``--exclude`` drops the rows whose statement is also
in another file (the test split: a training set that holds test tasks inflates every evaluation).

Prints progress, a summary and one JSON line. ``--out`` gets the rows that passed or could not be checked, as they
were read (JSONL); ``--report`` one line per row: file, row, status, pass rate, detail.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Iterator

from areal_jax.data.code_readers import code_row_to_record
from areal_jax.data.readers import _BadRow, jsonl_rows
from areal_jax.rewards.code_tests import parse_tests

__all__ = ["reference_solutions", "incorrect_solutions", "echo_program", "check_rows", "statement_key", "excluded_statements", "main"]

_CONTESTS_PYTHON3 = 3  # CodeContests' Language enum: 1 Python 2, 2 C++, 3 Python 3, 4 Java
_ECHO_LIMIT = 8 << 20  # the checker self-check embeds every case's input and output in one program


def _json_list(value: Any) -> list:
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return []
    return value if isinstance(value, list) else []


def incorrect_solutions(row: dict) -> list[str]:
    """The row's known-wrong programs in Python (CodeContests' ``incorrect_solutions``, its Python 3 ones)."""
    wrong = row.get("incorrect_solutions")
    if not isinstance(wrong, dict):
        return []
    languages, programs = wrong.get("language") or [], wrong.get("solution") or []
    return [p for lang, p in zip(languages, programs) if lang == _CONTESTS_PYTHON3 and isinstance(p, str) and p.strip()]


def reference_solutions(row: dict) -> list[str]:
    """The row's reference programs in Python, by layout (module doc); [] when it has none."""
    out: list[Any] = []
    solutions = row.get("solutions")
    if isinstance(solutions, dict):  # CodeContests: parallel lists of languages and programs
        languages, programs = solutions.get("language") or [], solutions.get("solution") or []
        out = [p for lang, p in zip(languages, programs) if lang == _CONTESTS_PYTHON3]
    elif solutions is not None:  # APPS / TACO
        out = _json_list(solutions)
    elif isinstance(row.get("canonical_solution"), str) and isinstance(row.get("prompt"), str):  # HumanEval
        out = [row["prompt"] + row["canonical_solution"]]
    elif isinstance(row.get("code"), str):  # MBPP
        out = [row["code"]]
    elif isinstance(row.get("solution"), str):
        out = [row["solution"]]
    return [p for p in out if isinstance(p, str) and p.strip()]


def echo_program(stdio: tuple[tuple[str, str], ...]) -> str:
    """A program that prints each case's listed output for its input: what a checker must accept."""
    table = json.dumps({stdin: expected for stdin, expected in stdio})
    return f"import json, sys\nsys.stdout.write(json.loads({table!r})[sys.stdin.read()])\n"


def _rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a JSONL (1-based lines) or Parquet file (0-based index, read in batches: a large file is
    never held whole)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        number = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            for row in batch.to_pylist():
                yield number, row
                number += 1
    elif path.endswith(".jsonl"):
        yield from jsonl_rows(path)
    else:
        raise ValueError(f"Cannot tell the format of {path!r}: name it *.jsonl or *.parquet.")


def statement_key(text: str) -> str:
    """A statement as compared for overlap: lower case, every run of whitespace one space."""
    return " ".join(text.lower().split())


def excluded_statements(paths: list[str]) -> set[str]:
    """The statement keys of every readable row of ``paths`` (e.g. the test split)."""
    keys = set()
    for path in paths:
        for number, row in _rows(path):
            try:
                if not isinstance(row, _BadRow):
                    keys.add(statement_key(code_row_to_record(path, number, row).question))
            except _BadRow:
                continue
    return keys


def _row_result(path: str, number: int, row: Any, max_references: int, max_incorrect: int,
                exclude: set[str] | None) -> tuple[dict, list[str], str, list[str]]:
    """(result, programs to run, tests JSON, known-wrong programs to run once one passes) of one row; no programs
    when there is nothing to run."""
    result = {"file": path, "row": number, "status": "unchecked", "pass_rate": None, "detail": "", "raw": row}
    try:
        if isinstance(row, _BadRow):
            raise row
        record = code_row_to_record(path, number, row)
    except _BadRow as err:
        where = "row index" if path.endswith(".parquet") else "line"
        result.update(status="bad_row", detail=f"{path}, {where} {number}: {err}", raw=None)
        return result, [], "", []
    if exclude and statement_key(record.question) in exclude:
        result.update(status="excluded", detail="its statement is in an --exclude file")
        return result, [], "", []
    spec = parse_tests(record.answer)
    programs = reference_solutions(row)[:max_references]
    if not programs and spec.checker:
        if sum(len(i) + len(o) for i, o in spec.stdio) > _ECHO_LIMIT:
            result["detail"] = "checker not checked: the tests are too large to embed"
            return result, [], "", []
        programs = [echo_program(spec.stdio)]
        result["detail"] = "checker"
    return result, programs, record.answer, incorrect_solutions(row)[:max_incorrect]


def _run_chunk(pool: Any, chunk: list[tuple[dict, list[str], str, list[str]]]) -> None:
    """Runs the first program of every row of ``chunk``, then the next of those that failed; once one passes, the
    row's known-wrong programs one by one, until one of them passes too (weak tests) or none is left."""
    pending = {}

    def submit(index: int, kind: str, k: int) -> None:
        _, programs, answer, wrong = chunk[index]
        pending[(index, kind, k)] = True
        pool.submit((index, kind, k), f"```python\n{(programs if kind == 'ref' else wrong)[k]}\n```", answer)

    for index, (_, programs, _, _) in enumerate(chunk):
        if programs:
            submit(index, "ref", 0)
    while pending:
        for res in pool.results(timeout=1.0):
            index, kind, k = res.key
            del pending[res.key]
            result, programs, _, wrong = chunk[index]
            if kind == "wrong":
                if res.reward == 1.0:
                    result.update(status="weak_tests", detail=f"known-wrong solution {k + 1} of the row's passes "
                                  "every case: the tests cannot tell it from a right one")
                elif k + 1 < len(wrong):
                    submit(index, "wrong", k + 1)
                continue
            best = max(result["pass_rate"] or 0.0, res.reward)
            result["pass_rate"] = best
            if res.reward == 1.0:
                result["status"] = "passed"
                if wrong:
                    submit(index, "wrong", 0)
            elif k + 1 < len(programs):
                submit(index, "ref", k + 1)
            elif result["detail"] == "checker":
                result.update(status="checker_rejects", detail=f"the checker accepted {best:.0%} of the listed outputs")
            else:
                result.update(status="failed", detail=f"the best of {len(programs)} reference solution(s) passed "
                              f"{best:.0%} of the cases" + (f" ({res.status}: {res.error})" if res.error else ""))


def check_rows(paths: list[str], *, workers: int = 2, max_references: int = 3, max_incorrect: int = 3,
               limit: int | None = None,
               case_timeout_s: float = 6.0, sample_timeout_s: float = 60.0, exclude: set[str] | None = None,
               chunk_rows: int = 256, progress: Any = print) -> Iterator[dict]:
    """One result per row of ``paths``, in order, ``chunk_rows`` rows at a time (a large dataset is never held whole):
    {"file", "row", "status", "pass_rate", "detail", "raw"}. status: "bad_row", "excluded" (its statement is one of
    ``exclude``'s keys: e.g. a test task in the training set), "unchecked", "passed", "failed" (no reference passed every
    case; pass_rate is the best one's), "checker_rejects" (the checker refused a listed output) or "weak_tests" (a
    reference passed, and so did one of the row's first ``max_incorrect`` known-wrong solutions)."""
    from areal_jax.rewards.code import make_code_reward
    from areal_jax.rewards.pool import RewardPool

    def rows() -> Iterator[tuple[str, int, Any]]:
        for path in paths:
            for number, row in _rows(path):
                yield path, number, row

    reward = make_code_reward(mode="pass_rate", case_timeout_s=case_timeout_s, sample_timeout_s=sample_timeout_s)
    start, seen, chunk = time.monotonic(), 0, []
    with RewardPool(reward, num_workers=workers, timeout_s=sample_timeout_s + 10.0) as pool:
        for i, (path, number, row) in enumerate(rows()):
            if limit is not None and i >= limit:
                break
            chunk.append(_row_result(path, number, row, max_references, max_incorrect, exclude))
            if len(chunk) == chunk_rows:
                _run_chunk(pool, chunk)
                seen += len(chunk)
                yield from (result for result, _, _, _ in chunk)
                chunk = []
                if progress:
                    progress(f"[check] {seen} rows checked ({time.monotonic() - start:.0f} s)")
        _run_chunk(pool, chunk)
        yield from (result for result, _, _, _ in chunk)
        if progress:
            progress(f"[check] {seen + len(chunk)} rows checked ({time.monotonic() - start:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_jax.programs.check_code_data", description=__doc__.split("\n")[0])
    p.add_argument("--data", action="append", required=True, help="a JSONL or Parquet file of code tasks (repeatable)")
    p.add_argument("--out", help="write the rows that passed or could not be checked here (JSONL)")
    p.add_argument("--report", help="write one JSON line per row here")
    p.add_argument("--workers", type=int, default=2, help="sandbox worker processes")
    p.add_argument("--max_references", type=int, default=3, help="reference solutions tried per row")
    p.add_argument("--max_incorrect", type=int, default=3, help="known-wrong solutions (CodeContests' "
                   "incorrect_solutions) run per row whose reference passed; one that passes marks weak tests (0: none)")
    p.add_argument("--limit", type=int, default=None, help="check only the first N rows")
    p.add_argument("--exclude", action="append", default=[], help="drop rows whose statement is in this file "
                   "(e.g. the test split: train / test overlap), compared without case and spacing (repeatable)")
    p.add_argument("--case_timeout_s", type=float, default=6.0, help="limit per test case")
    p.add_argument("--sample_timeout_s", type=float, default=60.0, help="limit for all cases of one solution")
    args = p.parse_args(argv)
    problems = [f"--{flag}={d!r} does not exist" for flag in ("data", "exclude") for d in getattr(args, flag)
                if not os.path.isfile(d)]
    problems += [f"--{k}={v} must be at least 1" for k, v in (("workers", args.workers),
                                                            ("max_references", args.max_references)) if v < 1]
    problems += [f"--max_incorrect={args.max_incorrect} must be at least 0"] if args.max_incorrect < 0 else []
    for flag in ("out", "report"):
        target = getattr(args, flag)
        if target and not os.access(os.path.dirname(os.path.abspath(target)), os.W_OK):
            problems.append(f"--{flag}={target!r} is not in a writable directory")
    if problems:
        print("Error: " + "; ".join(problems) + ".", file=sys.stderr)
        return 2
    counts = dict.fromkeys(("passed", "failed", "checker_rejects", "weak_tests", "unchecked", "excluded",
                            "bad_row"), 0)
    shown: list[dict] = []
    out = open(args.out, "w", encoding="utf-8") if args.out else None
    report = open(args.report, "w", encoding="utf-8") if args.report else None
    try:
        for r in check_rows(args.data, workers=args.workers, max_references=args.max_references,
                            max_incorrect=args.max_incorrect, limit=args.limit,
                            case_timeout_s=args.case_timeout_s, sample_timeout_s=args.sample_timeout_s,
                            exclude=excluded_statements(args.exclude)):
            counts[r["status"]] += 1
            if out and r["status"] in ("passed", "unchecked"):
                out.write(json.dumps(r["raw"], ensure_ascii=False, default=str) + "\n")
            if report:
                report.write(json.dumps({k: v for k, v in r.items() if k != "raw"}) + "\n")
            if r["status"] in ("failed", "checker_rejects", "weak_tests", "bad_row") and len(shown) < 10:
                shown.append(r)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    finally:
        for f in (out, report):
            if f:
                f.close()
    for r in shown:
        print(f"  {r['file']}:{r['row']}: {r['status']}: {r['detail']}")
    total, kept = sum(counts.values()), counts["passed"] + counts["unchecked"]
    print(f"{total} rows: {counts['passed']} passed, {counts['failed']} failed their reference solutions, "
          f"{counts['checker_rejects']} have a checker that rejects a listed output, {counts['weak_tests']} have tests a "
          f"known-wrong solution passes, {counts['unchecked']} could not be "
          f"checked (no reference, no checker), {counts['excluded']} in an --exclude file, {counts['bad_row']} "
          f"malformed; {kept} kept" + (f" in {args.out}" if args.out else ""))
    print(json.dumps({"rows": total, **counts, "kept": kept}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
