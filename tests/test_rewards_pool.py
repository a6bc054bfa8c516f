"""RewardPool: statuses, timeouts with worker replacement, isolation of samples, clean shutdown."""

import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_jax.rewards.pool import RewardPool, RewardResult, classify_reward


def misbehaving_reward(completion: str, answer: str):
    """Module-level (picklable) reward whose behaviour is chosen by the completion text."""
    if completion == "hang":
        time.sleep(120)
    if completion == "raise":
        raise ValueError("bad sample")
    if completion == "nan":
        return float("nan")
    if completion == "inf":
        return float("-inf")
    if completion == "str":
        return "1.0"
    if completion == "die":
        os._exit(3)
    return float(len(completion)) + float(answer)


def _alive(pid: int) -> bool:
    """Whether pid is a live (not zombie) process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_classify_reward_by_hand():
    import numpy as np

    assert classify_reward(1) == (1.0, "ok", None)
    assert classify_reward(True) == (1.0, "ok", None)
    assert classify_reward(np.float32(0.5)) == (0.5, "ok", None)
    assert classify_reward(np.array(2.0)) == (2.0, "ok", None)
    for bad in (float("nan"), float("inf"), "1.0", None, [1.0], np.array([1.0, 2.0])):
        reward, status, error = classify_reward(bad)
        assert (reward, status) == (0.0, "nan") and error


def test_every_failure_mode_is_isolated_and_counted():
    with RewardPool(misbehaving_reward, num_workers=2, timeout_s=1.5) as pool:
        first_pids = set(pool.worker_pids())
        items = [("a", "abc", "1"), ("hang", "hang", "0"), ("raise", "raise", "0"),
                 ("nan", "nan", "0"), ("inf", "inf", "0"), ("str", "str", "0"),
                 ("die", "die", "0"), ("b", "xy", "0.5")]
        t0 = time.monotonic()
        results = pool.score_batch(items)
        elapsed = time.monotonic() - t0
        by_key = {r.key: r for r in results}
        assert [r.key for r in results] == [k for k, _, _ in items]
        assert by_key["a"] == RewardResult("a", 4.0, "ok", None, by_key["a"].seconds)
        assert (by_key["b"].reward, by_key["b"].status) == (2.5, "ok")
        assert (by_key["hang"].reward, by_key["hang"].status) == (0.0, "timeout")
        assert 1.4 <= by_key["hang"].seconds < 10
        assert by_key["raise"].status == "error" and "ValueError: bad sample" in by_key["raise"].error
        for k in ("nan", "inf", "str"):
            assert (by_key[k].reward, by_key[k].status) == (0.0, "nan")
        assert by_key["die"].status == "error" and "exit code 3" in by_key["die"].error
        assert elapsed < 20
        c = pool.counters()
        assert (c["ok"], c["timeout"], c["error"], c["nan"]) == (2, 1, 2, 3)
        assert c["submitted"] == 8 and c["worker_restarts"] == 2
        assert c["pending"] == 0 and c["in_flight"] == 0
        # The hung worker was killed and replaced; the pool keeps working afterwards.
        new_pids = set(pool.worker_pids())
        assert len(new_pids - first_pids) == 2
        assert all(not _alive(p) for p in first_pids - new_pids)
        assert pool.score_batch([("x", "abcd", "0")])[0].reward == 4.0


def test_submit_results_and_get():
    with RewardPool("test_rewards_pool:misbehaving_reward", num_workers=2, timeout_s=2.0) as pool:
        assert pool.results(timeout=0.01) == []
        with pytest.raises(RuntimeError, match="nothing outstanding"):
            pool.get(timeout=0.01)
        for i in range(6):
            pool.submit(i, "a" * i, "0")
        got: list = []
        deadline = time.monotonic() + 30
        while len(got) < 6 and time.monotonic() < deadline:
            got += pool.results(timeout=5.0)
        assert sorted((r.key, r.reward) for r in got) == [(i, float(i)) for i in range(6)]
        assert pool.results(timeout=0.01) == []
        pool.submit("h", "hang", "0")
        with pytest.raises(TimeoutError):
            pool.get(timeout=0.2)
        assert pool.get(timeout=20).status == "timeout"


def test_math_reward_through_pool_and_close_leaves_no_processes():
    pool = RewardPool("areal_jax.rewards.math:math_reward", num_workers=2, timeout_s=20.0,
                      mp_context="forkserver")
    pids = pool.worker_pids()
    results = pool.score_batch([("#### 1,000", "1000"), ("\\boxed{\\frac{1}{2}}", "0.5"),
                                ("the answer is 7.", "8")])
    assert [(r.reward, r.status) for r in results] == [(1.0, "ok"), (1.0, "ok"), (0.0, "ok")]
    pool.close()
    pool.close()  # idempotent
    assert not any(_alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(0, "1", "1")


def test_rejects_unpicklable_and_bad_arguments():
    with pytest.raises(ValueError, match="module level"):
        RewardPool(lambda c, a: 1.0)
    with pytest.raises(ValueError, match="module:function"):
        RewardPool("not_a_spec")
    with pytest.raises(ValueError, match="could not load"):
        RewardPool("areal_jax.rewards.math:no_such_function")
    with pytest.raises(ValueError, match="spawn"):
        RewardPool(misbehaving_reward, mp_context="fork")
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(misbehaving_reward, timeout_s=0)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_exit_when_parent_is_killed(tmp_path, context):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from areal_jax.rewards.pool import RewardPool
        if __name__ == "__main__":
            pool = RewardPool("test_rewards_pool:misbehaving_reward", num_workers=2,
                              timeout_s=100, mp_context={context!r})
            pool.submit(0, "hang", "0")  # one worker busy in a hung reward, one idle
            time.sleep(1.5)
            print(" ".join(map(str, pool.worker_pids())), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=60)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    leftover = [p for p in pids if _alive(p)]
    for p in leftover:
        os.kill(p, signal.SIGKILL)
    assert not leftover, "reward workers outlived their parent"


def test_results_are_finite_floats():
    with RewardPool(misbehaving_reward, num_workers=1, timeout_s=5.0) as pool:
        for r in pool.score_batch([("abc", "0"), ("nan", "0")]):
            assert isinstance(r.reward, float) and math.isfinite(r.reward)


def hungry_reward(completion: str, answer: str) -> float:
    """Allocates far more memory than the worker may use when asked to."""
    if completion == "hungry":
        blob = bytearray(3 * 2**30)
        return float(len(blob))
    return 1.0


def test_memory_limit_turns_a_runaway_allocation_into_an_error_for_that_sample():
    with RewardPool("test_rewards_pool:hungry_reward", num_workers=1, timeout_s=20.0, memory_mb=1024) as pool:
        results = pool.score_batch([("a", "fine", "1"), ("b", "hungry", "1"), ("c", "fine", "1")])
    assert [r.status for r in results] == ["ok", "error", "ok"]
    assert "MemoryError" in results[1].error and results[1].reward == 0.0


def counting_reward(completion: str, answer: str) -> float:
    """Appends each call to the file named by $AREAL_TEST_REWARD_CALLS; "hang" sleeps past any timeout."""
    with open(os.environ["AREAL_TEST_REWARD_CALLS"], "a") as f:
        f.write(f"{completion}|{answer}\n")
    if completion == "hang":
        time.sleep(120)
    return float(len(completion)) + float(answer)


def test_identical_pairs_are_scored_once_and_only_answers_are_cached(tmp_path, monkeypatch):
    calls_file = tmp_path / "calls"
    monkeypatch.setenv("AREAL_TEST_REWARD_CALLS", str(calls_file))

    def calls() -> list[str]:
        return calls_file.read_text().split() if calls_file.exists() else []

    with RewardPool("test_rewards_pool:counting_reward", num_workers=1, timeout_s=1.0, cache_size=3) as pool:
        got = pool.score_batch([("a", "abc", "1"), ("b", "abc", "1"), ("c", "abc", "2"), ("d", "xy", "0")])
        assert [(r.key, r.reward, r.status) for r in got] == [
            ("a", 4.0, "ok"), ("b", 4.0, "ok"), ("c", 5.0, "ok"), ("d", 2.0, "ok")]
        assert sorted(calls()) == ["abc|1", "abc|2", "xy|0"]  # the repeat waited for the first's result
        # Scored earlier: answered at once from the cache, by either entry point.
        (again,) = pool.score_batch([("e", "abc", "1")])
        assert (again.reward, again.status, again.seconds) == (4.0, "ok", 0.0)
        pool.submit("f", "xy", "0")
        assert [(r.key, r.reward) for r in pool.results(timeout=10)] == [("f", 2.0)]
        assert len(calls()) == 3
        c = pool.counters()
        assert (c["submitted"], c["ok"], c["cached"]) == (6, 6, 3)
        # A kill is not the reward's answer: the pair waiting on it shares the timeout, a later one runs again.
        got = pool.score_batch([("h1", "hang", "0"), ("h2", "hang", "0")])
        assert [r.status for r in got] == ["timeout", "timeout"]
        assert pool.score_batch([("h3", "hang", "0")])[0].status == "timeout"
        assert calls().count("hang|0") == 2
        # Least recently used first out: three new pairs push "abc|1" out of a cache of 3.
        pool.score_batch([("p", "p", "0"), ("q", "q", "0"), ("r", "r", "0")])
        before = len(calls())
        assert pool.score_batch([("a2", "abc", "1")])[0].reward == 4.0
        assert len(calls()) == before + 1
    calls_file.unlink()
    with RewardPool("test_rewards_pool:counting_reward", num_workers=1, timeout_s=5.0) as pool:  # no cache
        pool.score_batch([("a", "abc", "1"), ("b", "abc", "1")])
        assert calls() == ["abc|1", "abc|1"] and pool.counters()["cached"] == 0
    with pytest.raises(ValueError, match="cache_size"):
        RewardPool(misbehaving_reward, cache_size=-1)
