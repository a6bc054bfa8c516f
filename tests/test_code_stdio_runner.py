"""The forked stdin/stdout runner (rewards/_stdio_harness.py) against a fresh sandboxed interpreter per case: the same
status for every case of every program kind, the same rewards, and no way for a program to write its own report."""
import subprocess
import sys
import time

import pytest

from areal_jax.rewards.code import code_tests_reward, run_tests
from areal_jax.rewards.code_tests import TestSpec as Spec
from areal_jax.rewards.code_tests import encode_tests
from areal_jax.rewards.sandbox import run_python_sandboxed

SPEC = Spec(stdio=(("1 2\n", "3\n"), ("5 5\n", "10\n"), ("100 -1\n", "99\n")))

PROGRAMS = {
    "input()": "a, b = map(int, input().split())\nprint(a + b)",
    "sys.stdin.read": "import sys\nd = sys.stdin.read().split()\nprint(int(d[0]) + int(d[1]))",
    "open(0)": "d = open(0).read().split()\nprint(int(d[0]) + int(d[1]))",
    "stdin.buffer": "import sys\nd = sys.stdin.buffer.read().split()\nprint(int(d[0]) + int(d[1]))",
    "readline loop": "import sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n    print(a + b)",
    "main guard": "def main():\n    a, b = map(int, input().split())\n    print(a + b)\nif __name__ == '__main__':\n    main()",
    "no newline": "import sys\na, b = map(int, input().split())\nsys.stdout.write(str(a + b))",
    "stderr noise": "import sys\na, b = map(int, input().split())\nprint('debug', file=sys.stderr)\nprint(a + b)",
    "deep recursion in a thread": (
        "import sys, threading\nsys.setrecursionlimit(10**6)\nthreading.stack_size(2**26)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
        "def main():\n    a, b = map(int, input().split())\n    print(a + b + depth(30000) - 30000)\n"
        "threading.Thread(target=main).start()"),
    "right on one case": "a, b = map(int, input().split())\nprint(10 if a == 5 else 0)",
    "wrong": "print(0)",
    "uncaught exception": "raise ValueError('no')",
    "exit(0) before printing": "import sys\nsys.exit(0)",
    "exit(3) after printing": "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)",
    "sys.exit(message)": "import sys\nsys.exit('bye')",
    "os._exit without flush": "import os\nprint(3)\nos._exit(0)",
    "syntax error": "def f(:\n    pass",
    "starts a process": "import os\nos.fork()\nprint(3)",
    "output past the cap": "print('x' * 2_000_000)",
    "prints then crashes": "a, b = map(int, input().split())\nprint(a + b)\n1 / 0",
    "exit() builtin": "a, b = map(int, input().split())\nprint(a + b)\nexit()\nprint('never')",
    "quit(2) builtin": "a, b = map(int, input().split())\nprint(a + b)\nquit(2)",
    "atexit output": ("import atexit, sys\nout = []\natexit.register(lambda: sys.stdout.write(''.join(out)))\n"
                      "a, b = map(int, input().split())\nout.append(f'{a + b}\\n')"),
}
# Programs whose ending leans on the interpreter's exit: the builtins ``site`` adds (the sandbox starts without site),
# atexit functions and the flush of streams a program replaced (fast-output templates of contest solutions).
AT_EXIT = {
    "exit()": "a, b = map(int, input().split())\nprint(a + b)\nexit()\nprint('never')",
    "exit(0) in a branch": "a, b = map(int, input().split())\nif a == 5:\n    print(-1)\n    exit(0)\nprint(a + b)",
    "quit()": "print(int(input().split()[0]) * 2)\nquit()",
    "exit(3)": "print(1)\nexit(3)",
    "exit(message)": "print(1)\nexit('bye')",
    "repr(exit)": "print(repr(exit) == repr(quit).replace('quit', 'exit'))",
    "atexit writes the output": ("import atexit, io, sys\nbuf = io.StringIO()\n"
                                 "atexit.register(lambda: sys.stdout.write(buf.getvalue()))\n"
                                 "a, b = map(int, input().split())\nbuf.write(str(a + b) + '\\n')"),
    "sys.stdout replaced": ("import io, sys\nsys.stdout = io.StringIO()\na, b = map(int, input().split())\n"
                            "print(a + b)\nsys.__stdout__.write(sys.stdout.getvalue())"),
    "buffered writer flushed at exit": (
        "import io, os, sys\nclass Out(io.IOBase):\n    def __init__(self):\n        self.buf = io.BytesIO()\n"
        "    def write(self, s):\n        self.buf.write(s.encode())\n    def flush(self):\n"
        "        os.write(1, self.buf.getvalue())\n        self.buf = io.BytesIO()\nsys.stdout = Out()\n"
        "a, b = map(int, input().split())\nprint(a + b)"),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_each_case_has_the_status_a_fresh_interpreter_gives(name):
    program = PROGRAMS[name]
    forked = run_tests(program, SPEC, mode="pass_rate", case_timeout_s=5.0, stdio_runner="fork")
    fresh = run_tests(program, SPEC, mode="pass_rate", case_timeout_s=5.0, stdio_runner="process")
    assert forked.statuses == fresh.statuses
    answer = encode_tests(SPEC)
    assert (code_tests_reward(program, answer, stdio_runner="fork")
            == code_tests_reward(program, answer, stdio_runner="process"))


@pytest.mark.parametrize("name", ["input()", "wrong", "uncaught exception", "exit(3) after printing",
                                  "starts a process", "output past the cap", "deep recursion in a thread"])
def test_a_runner_forked_from_the_zygote_gives_what_a_fresh_sandbox_gives(name):
    zygote = run_tests(PROGRAMS[name], SPEC, mode="pass_rate", case_timeout_s=5.0, launch="zygote")
    fresh = run_tests(PROGRAMS[name], SPEC, mode="pass_rate", case_timeout_s=5.0, launch="fresh")
    assert zygote.statuses == fresh.statuses


@pytest.mark.parametrize("name", sorted(AT_EXIT))
def test_a_program_ends_as_in_a_plain_interpreter(name):
    """The reference is the interpreter itself, with site: each case's exit status and output, then the statuses both
    runners give and a sandboxed run's exit code."""
    program = AT_EXIT[name]
    plain = [subprocess.run([sys.executable, "-c", program], input=stdin, capture_output=True, text=True, timeout=30)
             for stdin, _ in SPEC.stdio]
    want = tuple("error" if p.returncode else ("pass" if p.stdout.split() == expected.split() else "fail")
                 for p, (_, expected) in zip(plain, SPEC.stdio))
    for runner in ("fork", "process"):
        assert run_tests(program, SPEC, mode="pass_rate", stdio_runner=runner).statuses == want, runner
    result = run_python_sandboxed(program, stdin=SPEC.stdio[0][0])
    assert (result.exit_code, result.stdout) == (plain[0].returncode, plain[0].stdout)
    assert ("bye" in result.stderr) == ("bye" in plain[0].stderr)


def test_statuses_of_the_battery_are_what_each_program_does():
    """The reference itself, spelled out for a few programs (not only agreement between the runners)."""
    want = {"input()": ("pass",) * 3, "wrong": ("fail",) * 3, "uncaught exception": ("error",) * 3,
            "right on one case": ("fail", "pass", "fail"), "exit(3) after printing": ("error",) * 3,
            "os._exit without flush": ("fail",) * 3, "starts a process": ("error",) * 3}
    for name, statuses in want.items():
        assert run_tests(PROGRAMS[name], SPEC, mode="pass_rate", stdio_runner="fork").statuses == statuses, name


def test_a_hanging_program_times_out_and_all_pass_stops_at_the_first_case():
    t0 = time.monotonic()
    out = run_tests("while True:\n    pass", SPEC, mode="all_pass", case_timeout_s=0.5, stdio_runner="fork")
    assert out.statuses == ("timeout", "not_run", "not_run") and time.monotonic() - t0 < 2.5
    out = run_tests("import sys\nif sys.stdin.read().startswith('5'):\n    while True: pass\nprint(3)", SPEC,
                    mode="pass_rate", case_timeout_s=0.5, stdio_runner="fork")
    assert out.statuses == ("pass", "timeout", "fail")  # the runner goes on after a timeout when asked to


FORGER = r'''
import gc, json, os
nonce = next(o["nonce"] for o in gc.get_objects()
             if isinstance(o, dict) and isinstance(o.get("nonce"), str) and "inputs" in o)
forged = "".join(nonce + " " + json.dumps({"i": i, "status": "ok", "stdout": out}) + "\n"
                 for i, out in enumerate(["3\n", "10\n", "99\n"]))
print("\n" + forged, end="")
for fd in range(3, 64):  # any descriptor of the runner's stdout?
    try:
        os.write(fd, forged.encode())
    except OSError:
        pass
for path in ("/proc/self/fd/1", f"/proc/{os.getppid()}/fd/1"):
    try:
        with open(path, "w") as f:
            f.write(forged)
    except OSError:
        pass
'''


def test_a_program_that_finds_the_nonce_still_cannot_report_a_pass():
    finder = FORGER.split("forged =")[0] + "print('found', len(nonce))\n"
    assert run_tests(finder, Spec(stdio=(("", "found 32\n"),)), stdio_runner="fork").statuses == ("pass",)
    out = run_tests(FORGER, SPEC, mode="pass_rate", stdio_runner="fork")
    assert out.statuses == ("fail", "fail", "fail")
    assert code_tests_reward(FORGER, encode_tests(SPEC)) == 0.0


def test_many_cases_run_in_one_sandbox():
    spec = Spec(stdio=tuple((f"{i} {i}\n", f"{2 * i}\n") for i in range(60)))
    program = PROGRAMS["input()"]
    out = run_tests(program, spec, mode="all_pass", stdio_runner="fork")
    assert out.passed == out.total == 60
    bad = Spec(stdio=spec.stdio[:30] + (("1 1\n", "3\n"),) + spec.stdio[30:])
    out = run_tests(program, bad, mode="all_pass", stdio_runner="fork")
    assert out.statuses == ("pass",) * 30 + ("fail",) + ("not_run",) * 30


def test_a_sandboxed_run_stops_when_its_output_settles_the_outcome():
    from areal_jax.rewards.code_tests import outputs_match
    from areal_jax.rewards.harness_runs import FirstWrongOutput
    from areal_jax.rewards.sandbox import run_python_sandboxed

    seen = []

    def stop_at_two(chunk: bytes) -> bool:
        seen.append(chunk)
        return b"2\n" in b"".join(seen)

    program = "import time\nprint(1, flush=True)\nprint(2, flush=True)\ntime.sleep(60)\nprint(3)"
    result = run_python_sandboxed(program, timeout_s=90, stop_when=stop_at_two)
    assert result.status == "stopped" and result.stdout.startswith("1\n2\n") and "3" not in result.stdout
    assert result.seconds < 30  # the minute of sleep was not waited for
    # the runner's reports: a report line split across pieces, then a wrong output in the next one
    first_wrong = FirstWrongOutput("n0", lambda i, record: not outputs_match(record["stdout"], SPEC.stdio[i][1]))
    good, bad = b'n0 {"i": 0, "status": "ok", "stdout": "3\\n"}\n', b'n0 {"i": 1, "status": "ok", "stdout": "9"}\n'
    assert not first_wrong(good[:10]) and not first_wrong(good[10:]) and not first_wrong(b"x0 junk\n")
    assert first_wrong(bad[:5] + bad[5:])


NUMPY_SUM = "import numpy as np\nprint(int(np.array(input().split(), dtype=np.int64).sum()))"


@pytest.mark.parametrize("runner", ["fork", "process"])
def test_numpy_imports_only_when_allowed_and_ctypes_never(runner):
    answer = encode_tests(SPEC)
    assert code_tests_reward(NUMPY_SUM, answer, stdio_runner=runner) == 0.0  # the default sandbox refuses it
    assert code_tests_reward(NUMPY_SUM, answer, stdio_runner=runner, allow_numpy=True) == 1.0
    out = run_tests("import ctypes\nprint(3)", SPEC, mode="pass_rate", stdio_runner=runner, allow_numpy=True)
    assert out.statuses == ("error",) * 3
    probe = "import numpy, sys\nprint(int('ctypes' in sys.modules), numpy.ctypeslib.ctypes is None)"
    assert run_tests(probe, Spec(stdio=(("", "0 True\n"),)), stdio_runner=runner, allow_numpy=True).passed == 1


def test_numpy_in_call_cases_follows_the_same_switch():
    from areal_jax.rewards.code_tests import asserts_to_spec

    answer = encode_tests(asserts_to_spec(["assert f(3) == 6", "assert f(10) == 20"]))
    program = "import numpy as np\ndef f(x):\n    return int(np.int64(x) * 2)"
    assert code_tests_reward(program, answer) == 0.0
    assert code_tests_reward(program, answer, allow_numpy=True) == 1.0
    from areal_jax.rewards.config import RewardConfig

    scorer = RewardConfig(fn="code", timeout_s=30.0, code_allow_numpy=True).scorer()  # what the job's pool runs
    assert scorer(program, answer) == 1.0 and RewardConfig(fn="code", timeout_s=30.0).scorer()(program, answer) == 0.0


def test_all_pass_stops_a_call_harness_at_the_first_wrong_value():
    from areal_jax.rewards.code_tests import asserts_to_spec

    spec = asserts_to_spec(["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 6"])
    program = "import time\ndef f(x):\n    if x == 2:\n        time.sleep(60)\n    return x * 2 if x != 1 else 0"
    t0 = time.monotonic()
    out = run_tests(program, spec, mode="all_pass", case_timeout_s=20.0)
    assert out.statuses == ("fail", "not_run", "not_run") and time.monotonic() - t0 < 10  # f(2)'s sleep not waited
    out = run_tests(program, spec, mode="pass_rate", case_timeout_s=1.0)
    assert out.statuses == ("fail", "timeout", "pass")  # without all_pass every case runs


@pytest.mark.parametrize("runner", ["fork", "process"])
def test_each_stdin_case_has_the_same_cpu_limit_in_both_runners(runner):
    probe = "import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU))"
    out = run_tests(probe, Spec(stdio=(("", "(4, 5)\n"),)), case_timeout_s=2.5, stdio_runner=runner)
    assert out.statuses == ("pass",)  # ceil(case_timeout_s) + 1 CPU seconds for the case's own process


@pytest.mark.parametrize("runner", ["fork", "process"])
def test_a_right_answer_longer_than_a_megabyte_passes_and_a_flood_is_still_cut(runner):
    """The output cap follows the expected output (twice it, at least 1 MiB): 200,000 numbers (1.4 MB) pass, and a
    program printing far more than the expected output is stopped at the cap."""
    n = 200_000
    expected = "\n".join(str(i * 7919 % 1000003) for i in range(n)) + "\n"
    spec = Spec(stdio=((f"{n}\n", expected), ("1\n", "0\n")))
    right = "n = int(input())\nprint('\\n'.join(str(i * 7919 % 1000003) for i in range(n)))"
    assert len(expected) > (1 << 20)
    assert run_tests(right, spec, mode="pass_rate", stdio_runner=runner).statuses == ("pass", "pass")
    flood = "n = int(input())\nprint('\\n'.join(str(i * 7919 % 1000003) for i in range(n)))\nprint('x' * (n * 40))"
    # the second case's flood is 40 characters: a wrong output, under its cap
    assert run_tests(flood, spec, mode="pass_rate", stdio_runner=runner).statuses == ("error", "fail")


def test_inputs_of_many_megabytes_run_in_the_forked_runner():
    """Three cases of 6.9 MB each make a 20 MB payload, more than a zygote's run takes as its stdin file (16 MiB a
    file): the runner then starts in a fresh sandbox, and every case still runs and passes."""
    nums = [i * 7919 % 1000003 for i in range(1_000_000)]
    text = f"{len(nums)}\n" + " ".join(map(str, nums)) + "\n"
    spec = Spec(stdio=((text, f"{sum(nums)}\n"),) * 3)
    program = "import sys\nd = sys.stdin.buffer.read().split()\nprint(sum(map(int, d[1:])))"
    assert len(text) * 3 > (16 << 20)
    assert run_tests(program, spec, mode="pass_rate", stdio_runner="fork").statuses == ("pass",) * 3


def test_one_input_larger_than_the_sandboxs_file_limit_runs_in_the_forked_runner():
    """A single case of 19.7 MiB is more than the 16 MiB a sandboxed process may write as one file (the runner writes
    each case's input to a file, as a judge does, so that os.fstat(0) gives its size): that runner starts with the
    limit raised to hold it."""
    nums = [i * 7919 % 1000003 for i in range(3_000_000)]
    text = f"{len(nums)}\n" + " ".join(map(str, nums)) + "\n"
    spec = Spec(stdio=((text, f"{sum(nums)}\n"), ("1\n5\n", "5\n")))
    program = "import io, os\nd = io.BytesIO(os.read(0, os.fstat(0).st_size)).read().split()\nprint(sum(map(int, d[1:])))"
    assert len(text) > (16 << 20)
    assert run_tests(program, spec, mode="pass_rate", stdio_runner="fork", case_timeout_s=20.0).statuses == ("pass",) * 2


@pytest.mark.parametrize("runner", ["fork", "process"])
def test_a_sample_with_less_time_left_than_a_case_limit_still_runs_its_cases(runner):
    """1.5 s for the sample, 4 s per case: the runner starts with a CPU limit below a case's, and its candidates keep
    that limit instead of failing to raise it (every case read "error" in the forked runner)."""
    spec = Spec(stdio=(("1 2\n", "3\n"), ("5 5\n", "10\n")))
    out = run_tests(PROGRAMS["input()"], spec, mode="pass_rate", case_timeout_s=4.0, sample_timeout_s=1.5,
                    stdio_runner=runner)
    assert out.statuses == ("pass", "pass")
