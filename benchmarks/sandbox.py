"""Sandboxed test execution at throughput: what the code reward costs, and what the reward pool sustains.

    python benchmarks/sandbox.py [--n 64] [--workers 2]

Measures, one after another on this machine:
  a. a bare interpreter start, ``python -c 'print(1)'`` (subprocess.run in a new session), per run, and with
     ``-I -B -S`` (isolated mode, no site module or .pth hooks: how the sandbox starts its interpreter);
  b. one sandboxed run of the same program (rewards/sandbox.py: namespaces, limits, audit hook), per run;
  b2. the same program run forked from a zygote (rewards.zygote: a long-lived sandboxed process forking a fresh
     run per request), per run;
  c. one sample of a synthetic task (5 assert cases, one harness) through code_tests_reward, its harness forked
     from the zygote (the default) against started in a fresh sandbox (launch="fresh");
  d. the RewardPool with --workers processes scoring --n assert samples and --n stdin samples (3 cases in one
     forked runner each): sandbox executions/s, test cases/s and samples/s, with zygotes (the default) and with
     a fresh sandbox per harness;
  e. one sample of a stdin task with --stdin-cases cases (TACO / DeepCoder rows hold tens to hundreds): the
     default (a runner forked from the zygote, forking a candidate per case) against a fresh sandboxed
     interpreter per case (stdio_runner="process", launch="fresh": how every stdin case ran before), for a
     correct program and for one that fails at the middle case (all_pass stops there): ms per sample, ratio;
  f. what Landlock costs (where the kernel has it): b and b2 without it against with it (the default);
  g. the e sample judged by a special checker (code_checker: a second runner forks the checker per case) against
     compared outside the sandbox.
Prints the matmul peak and the load average beside the figures (the CPU may be shared) and ends with
one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_jax.rewards.code import code_tests_reward, make_code_reward  # noqa: E402
from areal_jax.rewards.code_tests import TestSpec, asserts_to_spec, encode_tests  # noqa: E402
from areal_jax.rewards.pool import RewardPool  # noqa: E402
from areal_jax.rewards.sandbox import landlock_abi, run_python_sandboxed, sandbox_layers  # noqa: E402
from areal_jax.rewards.zygote import SandboxZygote, run_forked  # noqa: E402

ASSERT_TASK = encode_tests(asserts_to_spec([f"assert f({x}) == {sum(map(int, str(x)))}"
                                            for x in (0, 7, 58, 406, 4071)]))
ASSERT_PROGRAM = "def f(x):\n    return sum(int(d) for d in str(x))"
STDIO_TASK = encode_tests(TestSpec(stdio=(("1 2\n", "3\n"), ("10 -4\n", "6\n"), ("7 7\n", "14\n"))))
STDIO_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"


def _per_run(fn, n: int) -> float:
    fn()  # warm the page cache
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=64, help="samples of each kind through the pool")
    p.add_argument("--serial", type=int, default=20, help="repeats of each serial measurement")
    p.add_argument("--workers", type=int, default=2, help="reward pool processes")
    p.add_argument("--stdin-cases", type=int, default=50, help="cases of the stdin task of e")
    args = p.parse_args()

    from benchmarks.common import matmul_peak_gflops

    peak = matmul_peak_gflops()
    load = os.getloadavg()
    print(f"matmul peak {peak:.1f} GFLOP/s; load average {load[0]:.1f} on {os.cpu_count()} cores; "
          f"sandbox: {sandbox_layers()}", flush=True)

    # Both baselines start their child in a new session as the sandbox does: under Linux's autogroup
    # scheduling a new session gets its own CPU share, which on a loaded machine alone changes the
    # start-up time several-fold.
    bare = _per_run(lambda: subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, check=True,
                                           start_new_session=True), args.serial)
    bare_isolated = _per_run(lambda: subprocess.run([sys.executable, "-I", "-B", "-S", "-c", "print(1)"],
                                                    capture_output=True, check=True, start_new_session=True),
                             args.serial)
    sandboxed = _per_run(lambda: run_python_sandboxed("print(1)"), args.serial)
    forked = _per_run(lambda: run_forked("print(1)"), args.serial)
    harness = _per_run(lambda: code_tests_reward(ASSERT_PROGRAM, ASSERT_TASK), args.serial)
    harness_fresh = _per_run(lambda: code_tests_reward(ASSERT_PROGRAM, ASSERT_TASK, launch="fresh"), args.serial)
    assert code_tests_reward(ASSERT_PROGRAM, ASSERT_TASK) == 1.0 and code_tests_reward(STDIO_PROGRAM, STDIO_TASK) == 1.0
    print(f"a. bare python -c: {bare * 1e3:.1f} ms (python -I -B -S -c, as the sandbox starts it: "
          f"{bare_isolated * 1e3:.1f} ms); b. sandboxed: {sandboxed * 1e3:.1f} ms ({sandboxed / bare:.2f}x of "
          f"python -c, {sandboxed / bare_isolated:.2f}x of python -I -B -S -c); c. one 5-assert sample: "
          f"{harness * 1e3:.1f} ms (harness in a fresh sandbox: {harness_fresh * 1e3:.1f} ms, "
          f"{harness_fresh / harness:.1f}x); b2. forked from the zygote: {forked * 1e3:.1f} ms "
          f"({sandboxed / forked:.1f}x faster than b)", flush=True)

    items = [(f"a{i}", ASSERT_PROGRAM, ASSERT_TASK) for i in range(args.n)]
    items += [(f"s{i}", STDIO_PROGRAM, STDIO_TASK) for i in range(args.n)]
    pool_seconds = {}
    for launch in ("fresh", "zygote"):
        with RewardPool(make_code_reward(launch=launch), num_workers=args.workers, timeout_s=60.0,
                        cache_size=0) as pool:
            pool.score_batch(items[:args.workers])  # workers started and warm
            t0 = time.perf_counter()
            results = pool.score_batch(items)
            pool_seconds[launch] = time.perf_counter() - t0
        assert all(r.reward == 1.0 for r in results), [r for r in results if r.reward != 1.0][:2]
    seconds = pool_seconds["zygote"]
    executions = args.n * 2  # one harness process per assert sample, one forked runner per stdin sample
    cases = args.n * 5 + args.n * 3
    out = {
        "benchmark": "sandbox", "workers": args.workers, "samples": len(items),
        "bare_python_ms": round(bare * 1e3, 2), "sandboxed_run_ms": round(sandboxed * 1e3, 2),
        "bare_python_isolated_ms": round(bare_isolated * 1e3, 2),
        "sandbox_overhead_ratio": round(sandboxed / bare, 3),
        "sandbox_overhead_ratio_isolated": round(sandboxed / bare_isolated, 3), "assert_sample_ms": round(harness * 1e3, 2),
        "pool_executions_per_s": round(executions / seconds, 2), "pool_cases_per_s": round(cases / seconds, 2),
        "pool_samples_per_s": round(len(items) / seconds, 2),
        "pool_samples_per_s_fresh": round(len(items) / pool_seconds["fresh"], 2),
        "pool_zygote_speedup": round(pool_seconds["fresh"] / seconds, 2), "forked_run_ms": round(forked * 1e3, 2),
        "assert_sample_fresh_ms": round(harness_fresh * 1e3, 2), "matmul_peak_gflops": round(peak, 1),
        "load_average_1min": round(load[0], 2), "cpus": os.cpu_count(),
    }
    print(f"d. pool of {args.workers}: {out['pool_executions_per_s']} sandbox executions/s, "
          f"{out['pool_cases_per_s']} test cases/s, {out['pool_samples_per_s']} samples/s against "
          f"{out['pool_samples_per_s_fresh']} with a fresh sandbox per harness ({out['pool_zygote_speedup']}x)",
          flush=True)

    rng = __import__("random").Random(0)
    rows = [[rng.randint(-1000, 1000) for _ in range(100)] for _ in range(args.stdin_cases)]
    cases = tuple((f"{len(r)}\n{' '.join(map(str, r))}\n", f"{sum(r)}\n") for r in rows)
    many = encode_tests(TestSpec(stdio=cases))
    middle = args.stdin_cases // 2
    failing = encode_tests(TestSpec(stdio=cases[:middle] + ((cases[middle][0], "wrong\n"),) + cases[middle + 1:]))
    summing = "input()\nprint(sum(map(int, input().split())))"
    repeats = max(2, args.serial // 4)
    timed = {}
    for runner, launch in (("fork", "zygote"), ("process", "fresh")):
        kw = {"stdio_runner": runner, "launch": launch}
        assert code_tests_reward(summing, many, **kw) == 1.0
        assert code_tests_reward(summing, failing, **kw) == 0.0
        timed[runner] = (_per_run(lambda kw=kw: code_tests_reward(summing, many, **kw), repeats),
                         _per_run(lambda kw=kw: code_tests_reward(summing, failing, **kw), repeats))
    (fork_ok, fork_bad), (proc_ok, proc_bad) = timed["fork"], timed["process"]
    print(f"e. a {args.stdin_cases}-case stdin sample, correct: the default {fork_ok * 1e3:.0f} ms against "
          f"{proc_ok * 1e3:.0f} ms with a fresh interpreter per case (**{proc_ok / fork_ok:.1f}x**); failing at "
          f"case {middle + 1}: {fork_bad * 1e3:.0f} ms against {proc_bad * 1e3:.0f} ms ({proc_bad / fork_bad:.1f}x)",
          flush=True)
    out.update({"stdin_cases": args.stdin_cases, "stdin_sample_forked_ms": round(fork_ok * 1e3, 1),
                "stdin_sample_process_ms": round(proc_ok * 1e3, 1), "stdin_speedup": round(proc_ok / fork_ok, 2),
                "stdin_failing_forked_ms": round(fork_bad * 1e3, 1),
                "stdin_failing_process_ms": round(proc_bad * 1e3, 1),
                "stdin_failing_speedup": round(proc_bad / fork_bad, 2)})

    if landlock_abi():
        plain_fresh = _per_run(lambda: run_python_sandboxed("print(1)", landlock=False), args.serial)
        zygotes = {flag: SandboxZygote(landlock=flag) for flag in (False, True)}
        try:
            plain_forked, confined_forked = (_per_run(lambda z=zygotes[f]: z.run("print(1)"), args.serial)
                                             for f in (False, True))
        finally:
            for z in zygotes.values():
                z.close()
        print(f"f. Landlock: a fresh sandboxed run {sandboxed * 1e3:.1f} ms against {plain_fresh * 1e3:.1f} ms without "
              f"it ({sandboxed / plain_fresh:.2f}x); a forked run {confined_forked * 1e3:.2f} ms against "
              f"{plain_forked * 1e3:.2f} ms ({confined_forked / plain_forked:.2f}x)", flush=True)
        out.update({"landlock_abi": landlock_abi(), "sandboxed_run_no_landlock_ms": round(plain_fresh * 1e3, 2),
                    "forked_run_landlock_ms": round(confined_forked * 1e3, 2),
                    "forked_run_no_landlock_ms": round(plain_forked * 1e3, 2),
                    "landlock_cost_fresh_ratio": round(sandboxed / plain_fresh, 3),
                    "landlock_cost_forked_ratio": round(confined_forked / plain_forked, 3)})
    # g. the same sample judged by a checker (a special judge that re-reads the input and sums it) instead of compared
    checker = ("import sys\nnums = open(sys.argv[1]).read().split()[1:]\n"
               "print(1 if open(sys.argv[3]).read().split() == [str(sum(map(int, nums)))] else 0)")
    judged = encode_tests(TestSpec(stdio=cases, checker=checker))
    assert code_tests_reward(summing, judged) == 1.0 and code_tests_reward("print(0)", judged) == 0.0
    checked = _per_run(lambda: code_tests_reward(summing, judged), repeats)
    print(f"g. the same sample judged by a checker: {checked * 1e3:.0f} ms against {fork_ok * 1e3:.0f} ms compared "
          f"({checked / fork_ok:.2f}x: a second runner forks the checker per case)", flush=True)
    out.update({"stdin_sample_checker_ms": round(checked * 1e3, 1), "checker_cost_ratio": round(checked / fork_ok, 2)})

    print(json.dumps(out))


if __name__ == "__main__":
    main()
