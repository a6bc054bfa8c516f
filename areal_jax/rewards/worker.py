"""What runs inside a reward worker process, and the result type it reports.

Kept apart from the pool so a worker imports only this module and the reward function: no threads,
queues or multiprocessing bookkeeping of the parent.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing.connection as mp_connection
import numbers
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["RewardFn", "STATUSES", "RewardResult", "resolve_reward_fn", "classify_reward",
           "worker_main"]

RewardFn = Callable[[str, str], float]
STATUSES = ("ok", "timeout", "error", "nan")


@dataclass(frozen=True)
class RewardResult:
    """One scored sample. reward is 0.0 unless status == "ok"; error holds a message otherwise
    (None for "ok"); seconds is the time the reward function ran (for "timeout": until the kill)."""

    key: Any
    reward: float
    status: str
    error: str | None
    seconds: float


def resolve_reward_fn(spec: RewardFn | str) -> RewardFn:
    """A callable from a callable or a "package.module:function" string."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(
            f"reward_fn must be a callable or a 'module:function' string, got {spec!r}; for example "
            "'areal_jax.rewards.math:math_reward'.")
    module_name, attr = spec.split(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"could not load reward function {spec!r}: {e}. Check the module path "
                         "and that the function is defined at module level.") from e
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable.")
    return fn


def classify_reward(value: Any) -> tuple[float, str, str | None]:
    """(reward, status, error) for a reward function's return value: finite real -> "ok"; NaN, inf
    or anything that is not a real number (strings included) -> (0.0, "nan", message)."""
    is_scalar_array = getattr(value, "shape", None) == () and hasattr(value, "__float__")
    if isinstance(value, numbers.Real) or is_scalar_array:
        try:
            reward = float(value)
        except (TypeError, ValueError) as e:
            return 0.0, "nan", f"reward could not be converted to float: {e}"
        if math.isfinite(reward):
            return reward, "ok", None
        return 0.0, "nan", f"reward function returned {reward}"
    return 0.0, "nan", f"reward function returned a non-number: {type(value).__name__}"


def worker_main(conn: mp_connection.Connection, lifeline: mp_connection.Connection,
                 spec: RewardFn | str, warmup: tuple[str, str] | None, memory_mb: int | None = None) -> None:
    """Worker process: score (task_id, completion, answer) messages until the pipe closes.

    ``lifeline`` is the read end of a pipe whose only write end lives in the pool's process and is
    never written: it reads EOF exactly when that process closes the pool or dies, even while the
    main thread is stuck inside the reward function. (The parent pid is no signal: under
    "forkserver" the parent is the fork server, which lives as long as any worker does.)
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    if memory_mb:  # a completion that makes the reward allocate without bound gets MemoryError, not the host
        import resource

        limit = int(memory_mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def watchdog() -> None:
        try:
            lifeline.poll(None)
        finally:
            os._exit(0)

    threading.Thread(target=watchdog, daemon=True, name="reward-worker-watchdog").start()
    try:
        fn = resolve_reward_fn(spec)
    except Exception as e:  # noqa: BLE001
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    if warmup is not None:
        try:
            fn(*warmup)
        except Exception:  # noqa: BLE001 - warm-up only imports and compiles
            pass
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, completion, answer = msg
        t0 = time.perf_counter()
        try:
            reward, status, error = classify_reward(fn(completion, answer))
        except BaseException as e:  # noqa: BLE001 - SystemExit from user code is an error too
            reward, status, error = 0.0, "error", f"{type(e).__name__}: {e}"
        conn.send(("result", task_id, reward, status, error, time.perf_counter() - t0))


