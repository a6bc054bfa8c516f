"""Untrusted model output: completions are data, never code, and a pathological one cannot stall the run.

* math_reward never evaluates completion text as Python: checked with an audit hook (PEP 578) in a
  fresh interpreter that records every process spawn, shell command, file write and any code object
  executed through exec/eval that names a dangerous builtin, while hostile completions are scored.
* Answers that make sympy run for ever ("parse bombs" such as 9^{9^{9^9}}) are cut off by the
  RewardPool's per-sample timeout; the pool keeps scoring the samples after them.
* Through the whole system: a run whose completions are such texts finishes its steps, scores
  nothing in the trainer's own process, and executes none of them.
The code sandbox (rewards/sandbox.py), which does run code on purpose, has its hostile-program
tests in tests/test_sandbox.py and tests/test_code_rewards.py; here the pass-everything programs and
escapes go through the reward pool as the RL job scores them.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

from areal_jax.rewards.pool import RewardPool
from areal_jax.system.job import MATH_REWARD_WARMUP
from areal_jax.testing.tiny import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _injections(marker: str) -> list[str]:
    cmd = f"__import__('os').system('touch {marker}')"
    return [
        cmd,
        f"\\boxed{{{cmd}}}",
        f"#### {cmd}",
        f"The answer is {cmd}.",
        f"#### 1 + {cmd}",
        f"\\boxed{{eval(\"{cmd}\")}}",
        f"$\\boxed{{\\text{{{cmd}}}}}$",
        f"(lambda: {cmd})()",
        f"#### open('{marker}', 'w').write('x')",
        f"\\boxed{{exec('import os; os.system(\"touch {marker}\")')}}",
        f"#### [c for c in ().__class__.__base__.__subclasses__()] and {cmd}",
    ]


PARSE_BOMBS = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{10^{10^{10}}}", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}"]

AUDIT_SCRIPT = r'''
import json, sys

DANGEROUS = {"__import__", "system", "popen", "exec", "eval", "open", "subprocess", "__subclasses__",
             "getattr", "compile"}
seen = []


def hook(event, args):
    if event in ("os.system", "subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork", "os.forkpty",
                 "os.spawn", "socket.connect", "ctypes.dlopen", "os.remove", "shutil.rmtree"):
        seen.append([event, repr(args)[:200]])
    elif event == "exec":  # code compiled from a string at run time (not a module being imported)
        code = args[0]
        names = set(getattr(code, "co_names", ())) & DANGEROUS
        if names and getattr(code, "co_filename", "<").startswith("<"):
            seen.append([event, sorted(names)])
    elif event == "compile" and any(w in str(args[0]) for w in ("__import__", "system", "lambda", "open(")):
        seen.append([event, str(args[0])[:200]])
    elif event == "open" and isinstance(args[1], str) and set(args[1]) & set("wax+"):
        seen.append([event, repr(args)[:200]])


def main():
    texts = json.loads(sys.argv[1])
    from areal_jax.rewards.math import math_reward

    # Import math-verify / sympy / latex2sympy before the hook starts watching.
    assert math_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0 and math_reward("#### 1/2 + 1", "3/2") == 1.0
    sys.addaudithook(hook)
    # 7/13: no number in a temporary path (pytest-7/...) can equal it, as a bare 7 could
    scores = [math_reward(t, "7/13") for t in texts] + [math_reward("7/13", t) for t in texts]
    scores.append(math_reward("so the answer is \\boxed{\\frac{7}{13}}", "7/13"))  # the hook does not break scoring
    n = len(seen)
    eval("getattr(__import__('os'), 'sep')")  # control: the hook does see code run from a string
    control, seen[n:] = seen[n:], []
    print(json.dumps({"scores": scores, "seen": seen, "control": control}))


main()
'''


def test_math_reward_never_executes_completion_text(tmp_path):
    marker = str(tmp_path / "PWNED")
    texts = _injections(marker)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", AUDIT_SCRIPT, json.dumps(texts)], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [e[0] for e in out["control"]] == ["compile", "exec"], out["control"]
    assert out["seen"] == [], out["seen"]
    assert out["scores"] == [0.0] * (2 * len(texts)) + [1.0]
    assert not os.path.exists(marker)


def test_parse_bombs_time_out_and_the_pool_keeps_scoring():
    good = [("#### 7", 1.0), ("the answer is 8", 0.0), ("\\boxed{\\frac{14}{2}}", 1.0)]
    texts = [t for pair in itertools.zip_longest(PARSE_BOMBS, good) for t in pair if t is not None]
    t0 = time.perf_counter()
    # As RLJob builds it: a replacement worker imports sympy (warm-up) before its clock starts.
    with RewardPool("areal_jax.rewards.math:math_reward", num_workers=2, timeout_s=1.0,
                    warmup=MATH_REWARD_WARMUP) as pool:
        results = pool.score_batch([(i, x if isinstance(x, str) else x[0], "7") for i, x in enumerate(texts)])
        counters = pool.counters()
    elapsed = time.perf_counter() - t0
    by_text = {(x if isinstance(x, str) else x[0]): r for x, r in zip(texts, results)}
    for bomb in PARSE_BOMBS:
        assert by_text[bomb].status == "timeout" and by_text[bomb].reward == 0.0, by_text[bomb]
    for text, reward in good:
        assert by_text[text].status == "ok" and by_text[text].reward == reward, by_text[text]
    assert counters["worker_restarts"] >= len(PARSE_BOMBS)
    assert elapsed < 60, elapsed


def test_hostile_completions_through_the_system_execute_nothing_and_stall_nothing(tmp_path, monkeypatch):
    from areal_jax.programs import rl as entry
    from areal_jax.rewards import math as math_rewards
    from areal_jax.tokenizer import Tokenizer

    marker = str(tmp_path / "PWNED")
    hostile = itertools.cycle(_injections(marker) + PARSE_BOMBS)
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, **kw: next(hostile))
    in_process = []  # rewards must be computed in the worker processes, never here

    def tripwire(*args, **kw):
        in_process.append(args)
        return 0.0

    monkeypatch.setattr(math_rewards, "math_reward", tripwire)
    monkeypatch.setattr(math_rewards, "answers_equal", tripwire)
    c = tiny_config(str(tmp_path / "assets"), steps=2)
    c.reward.timeout_s = 1.0
    c.reward.num_workers = 2
    t0 = time.perf_counter()
    summary = entry.run(c)
    assert summary["steps"] == 2
    assert time.perf_counter() - t0 < 120
    assert in_process == []
    assert not os.path.exists(marker)
    with open(os.path.join(c.run_dir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f][-1]
    assert last["rollout/reward_ok"] > 0
    with open(os.path.join(c.run_dir, "samples.jsonl")) as f:  # (a digit in the marker's path may match)
        assert {r for line in f for r in json.loads(line)["rewards"]} <= {0.0, 1.0}


def test_hostile_programs_score_zero_through_the_reward_pool_and_touch_nothing_outside(tmp_path):
    # The pass-everything hacks of tests/test_code_rewards.py plus escapes aimed at the trainer's files,
    # against value tests and the same tests as an opaque program, scored as the RL job scores them.
    from areal_jax.rewards.code import make_code_reward
    from areal_jax.rewards.code_tests import asserts_to_spec, encode_tests
    from areal_jax.testing.hostile_code import HOSTILE_PROGRAMS

    good = "def f(x):\n    return sum(int(d) for d in str(x))"
    marker = str(tmp_path / "PWNED")
    escapes = [f"open({marker!r}, 'w').write('x')\ndef f(x):\n    return 6",
               f"import os\nos.system('touch {marker}')\ndef f(x):\n    return 6",
               f"def f(x):\n    open({marker!r}, 'w').write('x')\n    return 6"]
    values = encode_tests(asserts_to_spec(["assert f(123) == 6", "assert f(4071) == 12"]))
    opaque = encode_tests(asserts_to_spec("def check(candidate):\n    for x, want in [(123, 6), (4071, 12)]:\n"
                                          "        assert candidate(x) == want\n", entry_point="f"))
    programs = list(HOSTILE_PROGRAMS.values()) + escapes + [good]
    items = [(i, f"```python\n{p}\n```", tests) for i, (p, tests) in
             enumerate((p, t) for p in programs for t in (values, opaque))]
    with RewardPool(make_code_reward("pass_rate", case_timeout_s=2.0, sample_timeout_s=8.0), num_workers=2,
                    timeout_s=20.0) as pool:
        results = pool.score_batch(items)
    assert all(r.status == "ok" for r in results), [r for r in results if r.status != "ok"]
    assert [r.reward for r in results] == [0.0] * (len(programs) - 1) * 2 + [1.0, 1.0]
    assert not os.path.exists(marker)
