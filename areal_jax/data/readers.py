"""Reading question/answer rows from JSONL and Parquet files, with row-numbered errors.

Every row becomes a :class:`Record` (question text plus the reference answer). A malformed row (bad
JSON, a missing field, a value of the wrong type, a GSM8K answer without its "####" marker) raises a
BadRowError (a ValueError) naming the file, the 1-based line (JSONL) or 0-based row index (Parquet) and
what was wrong; with ``on_bad_row="skip"`` it is skipped instead and counted in :class:`ReadStats`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Iterator, Sequence

__all__ = ["BadRowError", "Record", "ReadStats", "extract_reference_answer", "read_jsonl", "read_parquet",
           "read_records", "ANSWER_FORMATS", "MATH_QUESTION_FIELDS"]

ANSWER_FORMATS = ("auto", "gsm8k", "raw")
# question_field="auto": the first of these a row (or a Parquet file's columns) has; GSM8K names its
# statement "question", MATH / DeepScaleR / AIME sets "problem", many instruction sets "prompt".
MATH_QUESTION_FIELDS = ("question", "problem", "prompt")
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_MAX_KEPT_MESSAGES = 20


@dataclasses.dataclass(frozen=True)
class Record:
    """One usable row: ``row`` is the 1-based line (JSONL) or 0-based row index (Parquet)."""
    source: str
    row: int
    question: str
    answer: str


@dataclasses.dataclass
class ReadStats:
    """What reading saw: rows kept, malformed rows skipped and (the first few) reasons."""
    rows_kept: int = 0
    bad_rows_skipped: int = 0
    bad_row_messages: list[str] = dataclasses.field(default_factory=list)

    def add_bad(self, message: str) -> None:
        self.bad_rows_skipped += 1
        if len(self.bad_row_messages) < _MAX_KEPT_MESSAGES:
            self.bad_row_messages.append(message)


class _BadRow(Exception):
    """A row-level problem; turned into a BadRowError with the location, or skipped."""


class BadRowError(ValueError):
    """A malformed row with on_bad_row="error". ``problem`` is the file, row and what was wrong,
    without the hint, so an entry point can name its own setting (e.g. a config key) instead."""

    def __init__(self, problem: str, hint: str) -> None:
        super().__init__(f"{problem} {hint}")
        self.problem = problem


def extract_reference_answer(answer: str, answer_format: str = "auto") -> str:
    """The reference answer inside a dataset's answer field.

    answer_format:
      "gsm8k": the text after the last "####", stripped, with thousands separators removed
        ("#### 1,250" -> "1250"); a missing marker or nothing after it is a ValueError.
      "raw": the whole field, stripped.
      "auto": "gsm8k" when the field contains "####", else "raw".
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}.")
    if answer_format == "raw" or (answer_format == "auto" and "####" not in answer):
        return answer.strip()
    if "####" not in answer:
        raise ValueError("the answer has no '####' marker before the final answer (GSM8K layout); use "
                         "answer_format='raw' or 'auto' for datasets whose answer field is the answer itself")
    final = _THOUSANDS_SEPARATOR.sub("", answer.rsplit("####", 1)[1].strip())
    if not final:
        raise ValueError("nothing follows the '####' marker in the answer")
    return final


def _text_field(row: dict[str, Any], field: str, *, numbers_ok: bool) -> str:
    if field not in row:
        present = ", ".join(repr(k) for k in list(row)[:10])
        raise _BadRow(f"field {field!r} is missing (fields present: {present or 'none'}); pass "
                      f"question_field/answer_field to name the right ones")
    if row[field] is None:
        raise _BadRow(f"field {field!r} is null; give it a value or drop the row")
    value = row[field]
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow(f"field {field!r} is empty")
        return value
    if numbers_ok and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    kind = "a string or a number" if numbers_ok else "a string"
    raise _BadRow(f"field {field!r} must be {kind}, got {type(value).__name__} {value!r:.60}")


def _auto_question_field(present: Sequence[str]) -> str | None:
    """The first of MATH_QUESTION_FIELDS among ``present``, or None."""
    return next((f for f in MATH_QUESTION_FIELDS if f in present), None)


def _make_record(path: str, row_number: int, row: Any, question_field: str, answer_field: str,
                 answer_format: str) -> Record:
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {type(row).__name__}")
    if question_field == "auto":
        question_field = _auto_question_field(list(row))
        if question_field is None:
            present = ", ".join(repr(k) for k in list(row)[:10])
            raise _BadRow(f"no question field: none of {', '.join(map(repr, MATH_QUESTION_FIELDS))} is present "
                          f"(fields present: {present or 'none'}); pass question_field to name the right one")
    question = _text_field(row, question_field, numbers_ok=False)
    raw_answer = _text_field(row, answer_field, numbers_ok=True)
    try:
        answer = extract_reference_answer(raw_answer, answer_format)
    except ValueError as err:
        raise _BadRow(str(err)) from err
    return Record(source=path, row=row_number, question=question, answer=answer)


def jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed object) per non-blank line; a line that is not UTF-8 JSON yields a _BadRow. A
    byte-order mark at the start of the file (as some editors save UTF-8) is skipped; \r\n line ends read as \n."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if line_number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield line_number, _BadRow(f"not UTF-8 text (byte {raw[err.start]:#04x} at byte {err.start + 1}); "
                                           "save the file as UTF-8")
                continue
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as err:
                yield line_number, _BadRow(f"invalid JSON ({err.msg} at column {err.colno})")


def _check_on_bad_row(on_bad_row: str) -> None:
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}.")


def collect_rows(rows: Iterator[tuple[int, Any]], path: str, where: str, make: Callable[[int, Any], Record],
                 on_bad_row: str, stats: ReadStats) -> list[Record]:
    """`make(number, row)` of every (number, row) of a file; a row it rejects (_BadRow) stops the read with a
    BadRowError naming the file and its `where` ("line" / "row index") number, or is counted in `stats` and skipped."""
    records = []
    for number, row in rows:
        try:
            if isinstance(row, _BadRow):
                raise row
            records.append(make(number, row))
        except _BadRow as err:
            message = f"{path}, {where} {number}: {err}."
            if on_bad_row == "error":
                raise BadRowError(message, "Fix the row, or pass on_bad_row='skip' to skip such rows.") from None
            stats.add_bad(message)
    stats.rows_kept += len(records)
    return records


def _collect(rows: Iterator[tuple[int, Any]], path: str, where: str, question_field: str,
             answer_field: str, answer_format: str, on_bad_row: str,
             stats: ReadStats) -> list[Record]:
    return collect_rows(rows, path, where, lambda number, row: _make_record(
        path, number, row, question_field, answer_field, answer_format), on_bad_row, stats)


def read_jsonl(path: str, *, question_field: str = "auto", answer_field: str = "answer",
               answer_format: str = "auto", on_bad_row: str = "error",
               stats: ReadStats | None = None) -> tuple[list[Record], ReadStats]:
    """Reads a JSONL file (one JSON object per line; blank lines are ignored).

    question_field "auto" takes, per row, the first of MATH_QUESTION_FIELDS the row has."""
    _check_on_bad_row(on_bad_row)
    stats = ReadStats() if stats is None else stats

    records = _collect(jsonl_rows(path), path, "line", question_field, answer_field, answer_format, on_bad_row, stats)
    return records, stats


def read_parquet(path: str, *, question_field: str = "auto", answer_field: str = "answer",
                 answer_format: str = "auto", on_bad_row: str = "error",
                 stats: ReadStats | None = None) -> tuple[list[Record], ReadStats]:
    """Reads a Parquet file; rows are numbered by their 0-based index in the file.

    question_field "auto" takes the first of MATH_QUESTION_FIELDS among the file's columns."""
    import pyarrow.parquet as pq

    _check_on_bad_row(on_bad_row)
    stats = ReadStats() if stats is None else stats
    table = pq.read_table(path)
    if question_field == "auto":
        question_field = _auto_question_field(table.column_names) or MATH_QUESTION_FIELDS[0]
    missing = [f for f in (question_field, answer_field) if f not in table.column_names]
    if missing:
        raise ValueError(f"{path}: column(s) {missing} missing from the Parquet file (columns: "
                         f"{table.column_names}); pass question_field/answer_field to name the right ones.")
    questions = table.column(question_field).to_pylist()
    answers = table.column(answer_field).to_pylist()
    rows = ((i, {question_field: q, answer_field: a}) for i, (q, a) in enumerate(zip(questions, answers)))
    records = _collect(rows, path, "row index", question_field, answer_field, answer_format, on_bad_row, stats)
    return records, stats


def read_each(paths: str | Sequence[str], read_jsonl_file: Any, read_parquet_file: Any, stats: ReadStats,
              **options: Any) -> list[Record]:
    """The records of every file of ``paths``, in order, each read by the reader of its kind (``*.jsonl`` /
    ``*.parquet``) with ``options`` and the shared ``stats``; a missing file or an unknown kind is an error."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("No data files given; pass a .jsonl or .parquet path.")
    records: list[Record] = []
    for path in map(str, paths):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Data file {path!r} does not exist.")
        if path.endswith(".parquet"):
            reader = read_parquet_file
        elif path.endswith(".jsonl"):
            reader = read_jsonl_file
        else:
            raise ValueError(f"Cannot tell the format of {path!r}: name it *.jsonl or *.parquet.")
        records += reader(path, stats=stats, **options)[0]
    return records


def read_records(paths: str | Sequence[str], *, question_field: str = "auto",
                 answer_field: str = "answer", answer_format: str = "auto",
                 on_bad_row: str = "error") -> tuple[list[Record], ReadStats]:
    """Reads one or more .jsonl / .parquet files in order; an empty result is a ValueError."""
    stats = ReadStats()
    records = read_each(paths, read_jsonl, read_parquet, stats, question_field=question_field,
                        answer_field=answer_field, answer_format=answer_format, on_bad_row=on_bad_row)
    if not records:
        skipped = f" ({stats.bad_rows_skipped} malformed rows skipped)" if stats.bad_rows_skipped else ""
        raise ValueError(f"The dataset {paths} has no usable rows{skipped}; check the files and the "
                         f"field names ({question_field!r}, {answer_field!r}).")
    return records, stats
