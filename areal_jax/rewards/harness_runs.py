"""Running a test harness in the sandbox: trusted source that forks its own candidate processes and reports each case
as a stdout line "<nonce> <json>" (``_stdio_harness.py``, ``_code_harness.py``), and reading its reports."""
from __future__ import annotations

import json
from typing import Any, Callable

from areal_jax.rewards.sandbox import SandboxResult, run_python_sandboxed

__all__ = ["STARTUP_ALLOWANCE_S", "run_sandboxed_harness", "FirstWrongOutput", "harness_reports"]

STARTUP_ALLOWANCE_S = 2.0  # interpreter start-up of the harness process, on top of the case limits
FILE_BYTES = 16 << 20  # the sandbox's default limit per written file (run_python_sandboxed's max_file_bytes)
_FILE_SPARE = 1 << 20


def run_sandboxed_harness(source: str, payload: dict, *, timeout_s: float, memory_mb: int, max_output_bytes: int,
                          allow_numpy: bool, launch: str, stop_when: Any = None, largest_file: int = 0) -> SandboxResult:
    """A harness (trusted source that forks its own candidate processes) in the sandbox, with ``payload`` as its
    stdin: forked from a zygote, or in a fresh sandboxed interpreter (also when the zygote cannot start).
    ``largest_file``: the largest file the harness writes (a stdin case's input). A zygote's run writes its stdin as a
    file too, under the sandbox's per-file limit: when either would pass it (tests of many megabytes), the harness
    starts fresh, reading its stdin from a pipe, with the limit raised to hold its largest file."""
    stdin = json.dumps(payload)
    if max(len(stdin), largest_file) + _FILE_SPARE > FILE_BYTES:
        launch = "fresh"
    if launch == "zygote":
        from areal_jax.rewards.zygote import ZygoteError, run_forked

        try:
            return run_forked(source, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                              max_output_bytes=max_output_bytes, allow_numpy=allow_numpy, stop_when=stop_when)
        except (ZygoteError, OSError):
            pass  # e.g. no process creation here: the fresh sandbox below still scores the sample
    return run_python_sandboxed(source, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                                max_output_bytes=max_output_bytes, allow_subprocess=True, cpu_time_s=timeout_s + 1,
                                stop_when=stop_when, allow_numpy=allow_numpy,
                                max_file_bytes=max(FILE_BYTES, largest_file + _FILE_SPARE))


class FirstWrongOutput:
    """``stop_when`` of a harness's sandbox under all_pass: True once a complete report line holds a result that
    ``wrong(i, record)`` calls wrong (the outcome is settled; the remaining cases would read "not_run" anyway)."""

    def __init__(self, nonce: str, wrong: Callable[[int, dict], bool]) -> None:
        self.prefix, self.pieces, self.wrong = (nonce + " ").encode(), [], wrong

    def __call__(self, chunk: bytes) -> bool:
        if b"\n" not in chunk:  # a long report arrives in many pieces: joined once, when its line ends
            self.pieces.append(chunk)
            return False
        *lines, rest = b"".join([*self.pieces, chunk]).split(b"\n")
        self.pieces = [rest]
        for line in lines:
            if not line.startswith(self.prefix):
                continue
            try:
                record = json.loads(line[len(self.prefix):])
                i = record["i"]
            except (ValueError, KeyError, TypeError):
                continue
            if record.get("status") == "ok" and isinstance(i, int) and self.wrong(i, record):
                return True
        return False


def harness_reports(stdout: str, nonce: str) -> dict[int, dict]:
    """The first report of each case in a harness's stdout: lines "<nonce> <json object with an int 'i'>"."""
    reports: dict[int, dict] = {}
    prefix = nonce + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            record = json.loads(line[len(prefix):])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("i"), int) and record["i"] not in reports:
            reports[record["i"]] = record
    return reports
