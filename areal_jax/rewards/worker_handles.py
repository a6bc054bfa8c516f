"""The RewardPool's side of its worker processes: a handle per worker, starting and stopping them.

What runs inside a worker is rewards/worker.py; the pool (rewards/pool.py) decides which sample goes
where. A handle holds the process, its duplex pipe, whether it has loaded the reward function, and the
task it is scoring.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection as mp_connection
from typing import Any

from areal_jax.rewards.worker import worker_main


class WorkerHandle:
    def __init__(self, process: multiprocessing.process.BaseProcess, conn: mp_connection.Connection) -> None:
        self.process = process
        self.conn = conn
        self.ready = False
        self.task: Any = None  # the pool's task being scored, or None
        self.started_at = 0.0
        self.dead = False  # exited and not replaced (only after a fatal start-up error)


def start_worker(ctx: Any, lifeline: Any, spec: Any, warmup: Any, memory_mb: int | None) -> WorkerHandle:
    """Start one worker process (`ctx`: a spawn or forkserver context) that scores with `spec`; it exits
    on its own when `lifeline` (the read end of the pool's lifeline pipe) reaches EOF."""
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(target=worker_main, args=(child_conn, lifeline, spec, warmup, memory_mb),
                          daemon=True, name="reward-worker")
    process.start()
    child_conn.close()
    return WorkerHandle(process, parent_conn)


def stop_workers(workers: list[WorkerHandle]) -> None:
    """Ask idle, ready workers to exit and kill the rest; wait for all of them, close their pipes."""
    for w in workers:
        if w.task is not None or not w.ready or w.dead:
            w.process.kill()
        else:
            try:
                w.conn.send(None)
            except OSError:
                pass
    for w in workers:
        w.process.join(timeout=2.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=2.0)
        w.conn.close()


def kill_processes(processes: list) -> None:
    """Kill and reap `processes` (the pool's finalizer at interpreter exit)."""
    for p in list(processes):
        try:
            if p.is_alive():
                p.kill()
            p.join(timeout=1.0)
        except (OSError, ValueError, AssertionError):
            pass
