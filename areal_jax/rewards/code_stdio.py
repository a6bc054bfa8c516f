"""Running a program on a task's stdin/stdout cases (``TestSpec.stdio``) in the sandbox, and judging its outputs: by
``code_tests.outputs_match``, or by the task's checker (``code_checker``)."""
from __future__ import annotations

import os
import secrets
import time
from typing import Callable

from areal_jax.rewards.code_checker import checker_accepts, checker_program, checker_stdin
from areal_jax.rewards.code_tests import TestSpec, outputs_match
from areal_jax.rewards.harness_runs import STARTUP_ALLOWANCE_S, FirstWrongOutput, harness_reports, run_sandboxed_harness
from areal_jax.rewards.sandbox import run_python_sandboxed

__all__ = ["STDIO_RUNNERS", "run_stdio", "stdio_reports", "output_cap"]

_STDIO_HARNESS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stdio_harness.py")
# How stdin/stdout cases run: "fork" (one sandboxed runner forks a candidate process per case, about a millisecond
# each) or "process" (a fresh sandboxed interpreter per case, about 30 ms each); both give the same statuses.
STDIO_RUNNERS = ("fork", "process")
_STDIO_OUTPUT_BYTES = 1 << 20  # per case at least, as a sandboxed process's own max_output_bytes
_STDIO_OUTPUT_CEILING = 64 << 20  # per case at most, however long the expected output


def output_cap(expected: str) -> int:
    """The most bytes a stdin case's program may print: twice its expected output and some, rounded up to a power of
    two, at least 1 MiB (a right answer of 200,000 numbers is more than a megabyte), at most 64 MiB. The cap reaches the
    sandbox, so it tells a program nothing below half a megabyte and no more than a factor of two above."""
    need = 2 * len(expected.encode("utf-8", "replace")) + 4096
    return min(max(_STDIO_OUTPUT_BYTES, 1 << (need - 1).bit_length()), _STDIO_OUTPUT_CEILING)


def run_stdio(program: str, spec: TestSpec, deadline: float, case_timeout_s: float, memory_mb: int,
              stop_on_fail: bool, runner: str = "fork", allow_numpy: bool = False, launch: str = "zygote") -> list[str]:
    if runner == "fork":
        return _run_stdio_forked(program, spec, deadline, case_timeout_s, memory_mb, stop_on_fail, allow_numpy,
                                 launch)
    checker = checker_program(spec.checker) if spec.checker else None
    statuses = []
    for stdin, expected in spec.stdio:
        remaining = deadline - time.monotonic()
        if remaining <= 0.05 or (stop_on_fail and statuses and statuses[-1] != "pass"):
            statuses.append("not_run")
            continue
        result = run_python_sandboxed(f"{spec.setup}\n{program}" if spec.setup else program, stdin=stdin,
                                      timeout_s=min(case_timeout_s, remaining), memory_mb=memory_mb,
                                      allow_numpy=allow_numpy, max_output_bytes=output_cap(expected))
        if result.status == "timeout":
            statuses.append("timeout")
        elif result.status != "ok":
            statuses.append("error")
        elif checker is None:
            statuses.append("pass" if outputs_match(result.stdout, expected, spec.output_match) else "fail")
        else:
            remaining = deadline - time.monotonic()
            verdict = remaining > 0.05 and run_python_sandboxed(
                checker, stdin=checker_stdin(stdin, expected, result.stdout), timeout_s=min(case_timeout_s, remaining),
                memory_mb=memory_mb)
            statuses.append("pass" if verdict and checker_accepts(verdict.status, verdict.stdout) else "fail")
    return statuses


def stdio_reports(program: str, inputs: list[str], caps: list[int], deadline: float, case_timeout_s: float,
                  memory_mb: int, stop_on_error: bool, allow_numpy: bool, launch: str,
                  wrong: Callable[[int, dict], bool] | None) -> tuple[dict[int, dict], bool] | None:
    """``program`` on each of ``inputs`` in one sandboxed runner (``_stdio_harness.py``) that forks a process per case:
    ({case: its report}, whether the runner ran out of time), or None when no time is left. ``wrong(i, record)``: the
    runner is stopped from here at the first report it calls wrong; with ``stop_on_error`` it stops itself after a case
    that errs or times out."""
    n = len(inputs)
    nonce = secrets.token_hex(16)
    payload = {"nonce": nonce, "program": program, "inputs": list(inputs), "case_timeout_s": case_timeout_s,
               "max_output_bytes": list(caps), "stop_on_error": stop_on_error}
    budget = min(deadline - time.monotonic(), case_timeout_s * n + STARTUP_ALLOWANCE_S)
    if budget <= 0.05:
        return None
    # A report is its JSON-escaped output (up to 6 bytes a character for control characters) plus a few fields.
    cap = min(sum(6 * c + 256 for c in caps) + 4096, 512 << 20)
    from areal_jax.rewards.zygote import sandbox_source

    largest = max((len(text.encode("utf-8", "replace")) for text in inputs), default=0)  # written as a case's stdin
    result = run_sandboxed_harness(sandbox_source(_STDIO_HARNESS_PATH), payload, timeout_s=budget,
                                   memory_mb=memory_mb, max_output_bytes=cap, allow_numpy=allow_numpy, launch=launch,
                                   stop_when=FirstWrongOutput(nonce, wrong) if wrong is not None else None,
                                   largest_file=largest)
    return harness_reports(result.stdout, nonce), result.timed_out


def _run_stdio_forked(program: str, spec: TestSpec, deadline: float, case_timeout_s: float, memory_mb: int,
                      stop_on_fail: bool, allow_numpy: bool = False, launch: str = "zygote") -> list[str]:
    """The stdin/stdout cases in one sandboxed runner; the outputs are compared here as the reports arrive. With
    ``stop_on_fail`` the runner stops itself after a case that errs or times out, and is stopped from here at the first
    wrong output (it never sees the expected outputs). With a checker the outputs are judged afterwards, all cases at
    once, by the checker in a runner of its own (stopped at its first rejection under ``stop_on_fail``)."""
    n = len(spec.stdio)
    source = f"{spec.setup}\n{program}" if spec.setup else program

    def wrong_output(i: int, record: dict) -> bool:
        out = record.get("stdout")
        return 0 <= i < n and isinstance(out, str) and not outputs_match(out, spec.stdio[i][1], spec.output_match)

    cap = max(output_cap(e) for _, e in spec.stdio)  # one cap for every case: no case's length stands out
    ran = stdio_reports(source, [stdin for stdin, _ in spec.stdio], [cap] * n, deadline,
                        case_timeout_s, memory_mb, stop_on_fail, allow_numpy, launch,
                        wrong_output if stop_on_fail and not spec.checker else None)
    if ran is None:
        return ["not_run"] * n
    reports, timed_out = ran
    outputs = {i: r["stdout"] for i, r in reports.items()
               if r.get("status") == "ok" and isinstance(r.get("stdout"), str) and 0 <= i < n}
    if spec.checker and outputs:
        accepted = _checker_verdicts(spec, outputs, deadline, case_timeout_s, memory_mb, stop_on_fail, launch)
    else:
        accepted = {i: outputs_match(out, spec.stdio[i][1], spec.output_match) for i, out in outputs.items()}
    statuses = []
    for i in range(n):
        record = reports.get(i)
        if stop_on_fail and statuses and statuses[-1] != "pass":
            statuses.append("not_run")
        elif record is None:
            statuses.append("timeout" if timed_out else "not_run")
        elif record.get("status") == "timeout":
            statuses.append("timeout")
        elif i not in outputs:
            statuses.append("error")
        else:
            statuses.append("pass" if accepted.get(i) else "fail")
    return statuses


def _checker_verdicts(spec: TestSpec, outputs: dict[int, str], deadline: float, case_timeout_s: float,
                      memory_mb: int, stop_on_fail: bool, launch: str) -> dict[int, bool]:
    """{case: accepted} from the spec's checker over the cases in ``outputs`` (in case order), in one sandboxed
    runner; a case the checker did not judge (no time left, stopped after a rejection) is not accepted."""
    cases = sorted(outputs)
    inputs = [checker_stdin(spec.stdio[i][0], spec.stdio[i][1], outputs[i]) for i in cases]
    ran = stdio_reports(checker_program(spec.checker), inputs, [_STDIO_OUTPUT_BYTES] * len(cases), deadline,
                        case_timeout_s, memory_mb, False, False, launch,
                        (lambda j, record: not checker_accepts(record.get("status", ""), str(record.get("stdout"))))
                        if stop_on_fail else None)
    reports = ran[0] if ran is not None else {}
    return {i: j in reports and checker_accepts(reports[j].get("status", ""), str(reports[j].get("stdout")))
            for j, i in enumerate(cases)}
