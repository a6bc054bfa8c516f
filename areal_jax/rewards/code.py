"""Code-execution reward: run a completion's program against hidden tests in the sandbox.

    code_tests_reward(completion, answer, mode="all_pass")   # answer: code_tests.encode_tests(...) JSON

How cases run (rewards/sandbox.py contains every process):
  * stdin/stdout cases: one sandboxed process runs the stdio runner (``_stdio_harness.py``), which forks a
    candidate process per case, fed the case's input, with a pipe to the runner as its standard output and no
    other descriptor of it; the runner reports each output under a nonce the candidate cannot write with, and
    it is compared here, outside the sandbox, with ``outputs_match`` (by default token by token, real numbers
    within 1e-6, as a contest's checker reads an output; ``output_match`` chooses lines / tokens / numbers); the
    expected outputs never enter the sandbox. A program that exits early, prints nothing or crashes fails the
    case. ``stdio_runner="process"`` runs a fresh sandboxed interpreter per case instead (the same statuses,
    about 30 ms a case against about 1 ms for a fork).
  * call cases (APPS ``fn_name``, rewritten asserts) and opaque assert programs: one sandboxed process
    runs the harness (``_code_harness.py``), which forks a candidate process that loads the program
    and holds no descriptor but two pipes to the harness; every case has its own time limit. Call
    values come back as ``repr`` and are compared here, against expected values that never enter the
    sandbox. Opaque programs (asserts that are not ``<call> == <literal>``) run in the harness process,
    never beside the program, calling it through proxies that pass plain values only. So ``exit(0)``,
    ``os._exit``, ``raise SystemExit``, patched builtins or encoders, objects whose ``__eq__`` is always
    true, stolen report nonces and rewritten files all fail, for both kinds. Opaque tests that need the
    program's own objects (instances, arguments mutated in place, functions passed in) fail too.
Each harness's sandbox is forked from this thread's zygote (``rewards.zygote``: a long-lived sandboxed process that
never runs untrusted code and forks a fresh run process per sample, in about 4 ms against about 30 ms for a new
sandboxed interpreter; ``launch="fresh"`` starts one per sample instead, and is the fallback when no zygote starts).
Limits: ``case_timeout_s`` per case and ``sample_timeout_s`` for all cases of one sample; with
``mode="all_pass"`` the first failing case ends the sample: the harnesses, which never see expected outputs, stop
themselves at the first case that errs or times out, and are stopped from here at the first wrong output or value;
the statuses after a failed case read "not_run".
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import secrets
import textwrap
import time
from typing import Any

from areal_jax.rewards.code_stdio import STDIO_RUNNERS, run_stdio
from areal_jax.rewards.code_tests import (
    DEFAULT_OUTPUT_MATCH,
    OUTPUT_MATCHES,
    TestSpec,
    parse_tests,
    values_equal,
)
from areal_jax.rewards.harness_runs import STARTUP_ALLOWANCE_S, FirstWrongOutput, harness_reports, run_sandboxed_harness

__all__ = ["CODE_REWARD_MODES", "TestOutcome", "extract_program", "run_tests", "code_tests_reward",
           "code_all_pass", "code_pass_rate", "make_code_reward"]

CODE_REWARD_MODES = ("all_pass", "pass_rate")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_HARNESS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_code_harness.py")
# How a harness's sandbox starts: "zygote" (forked from this thread's long-lived sandboxed process, rewards.zygote:
# about 4 ms) or "fresh" (a new sandboxed interpreter, about 30 ms).
LAUNCHES = ("zygote", "fresh")


@functools.lru_cache(maxsize=1)
def _harness_source() -> str:
    with open(_HARNESS_PATH, encoding="utf-8") as f:
        return f.read()


@dataclasses.dataclass(frozen=True)
class TestOutcome:
    """passed / total cases, and one status per case ("pass", "fail", "error", "timeout", "not_run")."""
    passed: int
    total: int
    statuses: tuple[str, ...]

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_program(completion: str) -> str | None:
    """The program in a completion: the last fenced block tagged python / py / python3, else the last
    fenced block (an unterminated last fence runs to the end), else the text before any fence,
    dedented (a completion that continues "Answer:" with " def f(x): ..." is a program). None if empty."""
    if not isinstance(completion, str):
        return None
    blocks = _FENCE.findall(completion)
    if blocks:
        tagged = [body for tag, body in blocks if tag.lower() in ("python", "py", "python3")]
        body = (tagged or [body for _, body in blocks])[-1]
    else:
        body = completion.split("```", 1)[0]
    body = textwrap.dedent(body.strip("\n"))
    return body if body.strip() else None


def _run_harness(program: str, spec: TestSpec, deadline: float, case_timeout_s: float, memory_mb: int,
                 stop_on_fail: bool, allow_numpy: bool = False, launch: str = "zygote") -> list[str]:
    cases = [{"kind": "expr", "src": src} for src, _ in spec.calls]
    cases += [{"kind": "exec", "src": src} for src in spec.programs]
    nonce = secrets.token_hex(16)
    payload = {"nonce": nonce, "solution": program, "setup": spec.setup, "cases": cases,
               "case_timeout_s": case_timeout_s, "stop_on_error": stop_on_fail}
    budget = min(deadline - time.monotonic(), case_timeout_s * (len(cases) + 1) + STARTUP_ALLOWANCE_S)
    if budget <= 0.05:
        return ["not_run"] * len(cases)
    def wrong_value(i: int, record: dict) -> bool:  # a call case's returned value, judged here as below
        return i < len(spec.calls) and not _value_matches(record.get("value"), spec.calls[i][1])

    # Process creation is allowed for the harness's fork only: the candidate process denies it itself. Under
    # all_pass the harness is stopped at the first wrong value (it stops itself at the first error).
    result = run_sandboxed_harness(_harness_source(), payload, timeout_s=budget, memory_mb=memory_mb,
                                   max_output_bytes=4 << 20, allow_numpy=allow_numpy, launch=launch,
                                   stop_when=FirstWrongOutput(nonce, wrong_value) if stop_on_fail else None)
    reports = harness_reports(result.stdout, nonce)
    statuses = []
    for i in range(len(cases)):
        record = reports.get(i)
        if record is None:
            statuses.append("timeout" if result.timed_out else "not_run")
        elif record.get("status") != "ok":
            statuses.append("timeout" if record.get("status") == "timeout" else "error")
        elif i < len(spec.calls):
            statuses.append("pass" if _value_matches(record.get("value"), spec.calls[i][1]) else "fail")
        else:
            statuses.append("pass")
    return statuses


def _value_matches(text: Any, expected: Any) -> bool:
    import ast

    if not isinstance(text, str):
        return False
    try:
        got = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    if values_equal(got, expected):
        return True
    # APPS / TACO call-based outputs often wrap the return value in a one-element list.
    return isinstance(expected, list) and len(expected) == 1 and values_equal(got, expected[0])


def run_tests(program: str, spec: TestSpec, *, mode: str = "all_pass", case_timeout_s: float = 4.0,
              sample_timeout_s: float = 20.0, memory_mb: int = 512, stdio_runner: str = "fork",
              allow_numpy: bool = False, launch: str = "zygote", output_match: str = DEFAULT_OUTPUT_MATCH,
              time_limit_factor: float = 0.0) -> TestOutcome:
    """Runs every case of ``spec`` against ``program`` in the sandbox; see the module doc. stdio_runner: how the
    stdin/stdout cases run (STDIO_RUNNERS); allow_numpy: programs may import numpy (``run_python_sandboxed``);
    launch: how each harness's sandbox starts (LAUNCHES); output_match: how stdin cases' outputs are compared
    (``code_tests.outputs_match``) unless the spec names its own; time_limit_factor: when > 0, a spec with its own
    time limit (``time_limit_s``, its contest's) gets min(case_timeout_s, factor * time_limit_s) per case."""
    if mode not in CODE_REWARD_MODES:
        raise ValueError(f"mode must be one of {CODE_REWARD_MODES}, got {mode!r}.")
    if stdio_runner not in STDIO_RUNNERS:
        raise ValueError(f"stdio_runner must be one of {STDIO_RUNNERS}, got {stdio_runner!r}.")
    if launch not in LAUNCHES:
        raise ValueError(f"launch must be one of {LAUNCHES}, got {launch!r}.")
    if output_match not in OUTPUT_MATCHES:
        raise ValueError(f"output_match must be one of {OUTPUT_MATCHES}, got {output_match!r}.")
    if not spec.output_match:
        spec = dataclasses.replace(spec, output_match=output_match)
    if time_limit_factor < 0:
        raise ValueError(f"time_limit_factor must be >= 0 (0: the tasks' own time limits unused), got {time_limit_factor}.")
    if time_limit_factor > 0 and spec.time_limit_s > 0:
        case_timeout_s = min(case_timeout_s, time_limit_factor * spec.time_limit_s)
    if case_timeout_s <= 0 or sample_timeout_s <= 0:
        raise ValueError(f"time limits must be positive, got case_timeout_s={case_timeout_s}, "
                         f"sample_timeout_s={sample_timeout_s}.")
    stop = mode == "all_pass"
    deadline = time.monotonic() + sample_timeout_s
    statuses = []
    if spec.stdio:
        statuses += run_stdio(program, spec, deadline, case_timeout_s, memory_mb, stop, stdio_runner, allow_numpy,
                               launch)
    if spec.calls or spec.programs:
        if stop and any(s != "pass" for s in statuses):
            statuses += ["not_run"] * (len(spec.calls) + len(spec.programs))
        else:
            statuses += _run_harness(program, spec, deadline, case_timeout_s, memory_mb, stop, allow_numpy, launch)
    passed = sum(s == "pass" for s in statuses)
    return TestOutcome(passed=passed, total=len(statuses), statuses=tuple(statuses))


def code_tests_reward(completion: str, answer: str, *, mode: str = "all_pass", case_timeout_s: float = 4.0,
                      sample_timeout_s: float = 20.0, memory_mb: int = 512, stdio_runner: str = "fork",
                      allow_numpy: bool = False, launch: str = "zygote", output_match: str = DEFAULT_OUTPUT_MATCH,
                      time_limit_factor: float = 0.0) -> float:
    """Reward of one completion against the hidden tests in ``answer`` (code_tests JSON).

    mode "all_pass": 1.0 when every case passes, else 0.0. "pass_rate": the fraction of cases passed.
    A completion without a program scores 0.0. Raises ValueError only for malformed tests (a data bug,
    reported by the reward pool as an error for that sample).
    """
    spec = parse_tests(answer)
    program = extract_program(completion)
    if program is None:
        return 0.0
    outcome = run_tests(program, spec, mode=mode, case_timeout_s=case_timeout_s,
                        sample_timeout_s=sample_timeout_s, memory_mb=memory_mb, stdio_runner=stdio_runner,
                        allow_numpy=allow_numpy, launch=launch, output_match=output_match,
                        time_limit_factor=time_limit_factor)
    if mode == "pass_rate":
        return outcome.pass_rate
    return 1.0 if outcome.passed == outcome.total else 0.0


def code_all_pass(completion: str, answer: str) -> float:
    """code_tests_reward with the default limits, all-pass."""
    return code_tests_reward(completion, answer, mode="all_pass")


def code_pass_rate(completion: str, answer: str) -> float:
    """code_tests_reward with the default limits, pass rate."""
    return code_tests_reward(completion, answer, mode="pass_rate")


def make_code_reward(mode: str = "all_pass", case_timeout_s: float = 4.0, sample_timeout_s: float = 20.0,
                     memory_mb: int = 512, allow_numpy: bool = False, launch: str = "zygote",
                     stdio_runner: str = "fork", output_match: str = DEFAULT_OUTPUT_MATCH,
                     time_limit_factor: float = 0.0) -> functools.partial:
    """A picklable (completion, answer) -> float for the RewardPool, with these limits."""
    if mode not in CODE_REWARD_MODES:
        raise ValueError(f"reward.code_mode={mode!r} is not one of {', '.join(CODE_REWARD_MODES)}; pass "
                         f"--config.reward.code_mode=all_pass or pass_rate.")
    return functools.partial(code_tests_reward, mode=mode, case_timeout_s=float(case_timeout_s),
                             sample_timeout_s=float(sample_timeout_s), memory_mb=int(memory_mb),
                             allow_numpy=bool(allow_numpy), launch=launch, stdio_runner=stdio_runner,
                             output_match=output_match, time_limit_factor=float(time_limit_factor))
