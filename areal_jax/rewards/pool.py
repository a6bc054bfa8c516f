"""Reward computation off the accelerator: a pool of worker processes with per-sample timeouts.

Rewards (math-verify's sympy, sandboxed code) can be slow, can hang and can crash. The pool runs them in
``num_workers`` separate processes started with "spawn" or "forkserver" (never plain fork: the parent
runs JAX threads), one sample per worker at a time:
  * the reward function raises       -> reward 0.0, status "error", error = "ExcType: message";
  * it runs past ``timeout_s``        -> the worker is SIGKILLed and replaced, reward 0.0, "timeout";
  * it returns NaN, inf or a non-number -> reward 0.0, status "nan";
  * the worker process dies           -> reward 0.0, status "error", and it is replaced.
Other samples are unaffected. With ``cache_size`` > 0 identical (completion, answer) pairs are scored
once (rewards/pair_cache.py; leave it at 0 for rewards with randomness). ``timeout_s`` counts from the moment a sample reaches a worker, not from
``submit``; a new worker takes samples only once it has imported the reward function (and scored the
optional ``warmup`` sample), so start-up cost never counts as a timeout.

A background thread in the parent hands samples to idle workers, collects answers and enforces
deadlines. Workers exit on their own when the parent closes the pool or dies (a watchdog thread
reads EOF on a lifeline pipe), so nothing is left behind even after a SIGKILL of the parent.

Usage::

    with RewardPool("areal_jax.rewards.math:math_reward", num_workers=2, timeout_s=5.0) as pool:
        for i, (text, ref) in enumerate(samples):
            pool.submit(i, text, ref)
        done = pool.results(timeout=1.0)      # whatever finished, waiting up to 1 s for the first
        scored = pool.score_batch([("a", text, ref), ("b", text2, ref2)])  # blocking, in order
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import pickle
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from areal_jax.rewards.config import REWARD_FUNCTIONS, RewardConfig  # the `reward` section; imported from here too
from areal_jax.rewards.pair_cache import PairCache, pair_digest
from areal_jax.rewards.worker import (
    STATUSES,
    RewardFn,
    RewardResult,
    classify_reward,
    resolve_reward_fn,
)
from areal_jax.rewards.worker_handles import WorkerHandle, kill_processes, start_worker, stop_workers

__all__ = ["REWARD_FUNCTIONS", "RewardConfig", "RewardResult", "RewardPool", "resolve_reward_fn", "classify_reward"]


@dataclass
class _Task:
    task_id: int
    key: Any
    completion: str
    answer: str
    sink: queue.Queue
    pair: bytes = b""  # pair_digest(completion, answer) when the pool caches


class RewardPool:
    """Process pool that scores (completion, answer) pairs with ``reward_fn``; see the module doc.

    Args:
      reward_fn: picklable callable ``(completion: str, answer: str) -> float`` defined at module
        level, or an importable "module:function" string.
      num_workers: worker processes.
      timeout_s: per-sample limit, from hand-off to a worker.
      mp_context: "spawn" or "forkserver".
      warmup: optional (completion, answer) each new worker scores before taking samples (e.g. to
        import sympy before the clock starts).
      memory_mb: address-space limit (RLIMIT_AS) of each worker; a reward that allocates past it gets
        MemoryError, scored as an "error" for that sample only. None: no limit.
      cache_size: identical (completion, answer) pairs scored once, an LRU of this many answered pairs
        (rewards/pair_cache.py); 0: every sample is scored.
    """

    def __init__(self, reward_fn: RewardFn | str, *, num_workers: int = 2, timeout_s: float = 5.0,
                 mp_context: str = "spawn", warmup: tuple[str, str] | None = None,
                 memory_mb: int | None = None, cache_size: int = 0) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}.")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}.")
        if not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"cache_size must be an integer >= 0 (0: no cache), got {cache_size!r}.")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(
                f"mp_context must be 'spawn' or 'forkserver', got {mp_context!r}: forking a process "
                "that runs JAX threads can deadlock the child.")
        resolve_reward_fn(reward_fn)  # fail here, not in every worker
        if not isinstance(reward_fn, str):
            try:
                pickle.dumps(reward_fn)
            except Exception as e:  # noqa: BLE001
                raise ValueError(
                    f"reward_fn {reward_fn!r} cannot be pickled for the worker processes ({e}). "
                    "Define it at module level (no lambda or closure) or pass 'module:function'."
                ) from e
        self._spec = reward_fn
        self._warmup = warmup
        self._memory_mb = memory_mb  # address-space limit of each worker (None: no limit)
        self._timeout_s = float(timeout_s)
        self._ctx = multiprocessing.get_context(mp_context)
        self._lock = threading.Lock()
        self._pending: collections.deque[_Task] = collections.deque()
        self._results: queue.Queue = queue.Queue()
        self._outstanding = 0  # submitted via submit() and not yet handed out by results()/get()
        self._next_id = 0
        self._counters = collections.Counter({s: 0 for s in STATUSES})
        self._counters.update(submitted=0, worker_restarts=0, cached=0)
        self._cache = PairCache(cache_size) if cache_size else None  # rewards/pair_cache.py
        self._fatal: str | None = None
        self._startup_failures = 0  # consecutive worker deaths before "ready"
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self._lifeline_r, self._lifeline_w = self._ctx.Pipe(duplex=False)
        os.set_blocking(self._wake_w, False)
        self._processes: list = []  # shared with the finalizer, which kills leftovers at exit
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, kill_processes, self._processes)
        self._thread = threading.Thread(target=self._run, daemon=True, name="reward-pool")
        self._thread.start()

    # ----------------------------------------------------------------- public API
    def submit(self, key: Hashable, completion: str, answer: str) -> None:
        """Queue one sample; its RewardResult (with this key) comes back from results()/get()."""
        self._enqueue([(key, completion, answer)], self._results, count_outstanding=True)

    def results(self, timeout: float | None = None) -> list[RewardResult]:
        """Every result finished so far. When none is ready yet, wait up to ``timeout`` seconds for
        one (None: until one arrives). Returns [] when nothing is outstanding or on timeout."""
        with self._lock:
            if self._outstanding == 0 and self._results.empty():
                return []
        out: list[RewardResult] = []
        try:
            out.append(self._results.get(timeout=timeout))
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._outstanding -= len(out)
        return out

    def get(self, timeout: float | None = None) -> RewardResult:
        """The next finished result, waiting up to ``timeout`` seconds (None: forever)."""
        with self._lock:
            if self._outstanding == 0 and self._results.empty():
                raise RuntimeError("RewardPool.get() was called with nothing outstanding; "
                                   "submit() samples first.")
        try:
            result = self._results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no reward finished within {timeout} s.") from None
        with self._lock:
            self._outstanding -= 1
        return result

    def score_batch(self, items: Sequence[tuple]) -> list[RewardResult]:
        """Score (key, completion, answer) triples (or (completion, answer) pairs, keyed by index)
        and block until all are done; results in input order. Independent of submit()/results()."""
        triples = [tuple(it) if len(it) == 3 else (i, *it) for i, it in enumerate(items)]
        if any(len(t) != 3 for t in triples):
            raise ValueError("score_batch items must be (key, completion, answer) triples or "
                             "(completion, answer) pairs.")
        sink: queue.Queue = queue.Queue()
        ids = self._enqueue(triples, sink, count_outstanding=False)
        by_id = {}
        for _ in ids:
            task_id, result = sink.get()
            by_id[task_id] = result
        return [by_id[i] for i in ids]

    def counters(self) -> dict[str, int]:
        """Totals so far: submitted, ok, timeout, error, nan (every sample under its status), cached (of
        those, answered without running the reward: see cache_size), worker_restarts, plus the current
        number of samples waiting (pending) and being scored (in_flight)."""
        with self._lock:
            out = dict(self._counters)
            out["pending"] = len(self._pending)
            out["in_flight"] = sum(w.task is not None for w in self._workers)
        return out

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers."""
        with self._lock:
            return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Stop the workers and the background thread. Samples not yet scored are answered with
        status "error" ("reward pool closed"). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout=10.0)
        with self._lock:
            leftovers = list(self._pending) + [w.task for w in self._workers if w.task]
            self._pending.clear()
            workers, self._workers = self._workers, []
        for task in leftovers:
            self._emit(task, 0.0, "error", "reward pool closed before this sample was scored", 0.0,
                       count=False)
        stop_workers(workers)
        self._processes.clear()
        self._lifeline_w.close()
        self._lifeline_r.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._finalizer.detach()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals
    def _enqueue(self, triples: Sequence[tuple], sink: queue.Queue, *,
                 count_outstanding: bool) -> list[int]:
        with self._lock:
            if self._closed:
                raise RuntimeError("this RewardPool is closed; create a new one to score more.")
            if self._fatal is not None:
                raise RuntimeError(f"reward workers cannot start: {self._fatal}")
            ids, hits = [], []
            for key, completion, answer in triples:
                task = _Task(self._next_id, key, completion, answer, sink)
                self._next_id += 1
                ids.append(task.task_id)
                if self._cache is not None:
                    task.pair = pair_digest(completion, answer)
                    cached, score = self._cache.admit(task.pair, task)
                    if cached is not None:
                        hits.append((task, cached))
                    if not score:
                        continue
                self._pending.append(task)
            self._counters["submitted"] += len(ids)
            if count_outstanding:
                self._outstanding += len(ids)
            for task, (reward, status, error) in hits:
                self._counters["cached"] += 1
                self._emit(task, reward, status, error, 0.0)
        self._wake()
        return ids

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full (a wake-up is already pending) or closed

    def _start_worker(self) -> WorkerHandle:
        worker = start_worker(self._ctx, self._lifeline_r, self._spec, self._warmup, self._memory_mb)
        self._processes.append(worker.process)
        return worker

    def _emit(self, task: _Task, reward: float, status: str, error: str | None, seconds: float,
              count: bool = True) -> None:
        if count:
            self._counters[status] += 1
        result = RewardResult(task.key, reward, status, error, seconds)
        if task.sink is self._results:
            task.sink.put(result)
        else:
            task.sink.put((task.task_id, result))
        if self._cache is None:
            return
        for follower in self._cache.settle(task.pair, task, (reward, status, error)):
            if count:
                self._counters["cached"] += 1
            self._emit(follower, reward, status, error, 0.0, count=count)

    def _replace(self, worker: WorkerHandle) -> None:
        """Kill a worker (if still alive) and start a new one in its slot (lock held)."""
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=2.0)
        worker.conn.close()
        if worker.process in self._processes:
            self._processes.remove(worker.process)
        index = self._workers.index(worker)
        self._workers[index] = self._start_worker()
        self._counters["worker_restarts"] += 1

    def _fail_all(self, message: str) -> None:
        self._fatal = message
        while self._pending:
            self._emit(self._pending.popleft(), 0.0, "error", message, 0.0)

    def _handle_message(self, worker: WorkerHandle) -> None:
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            task = worker.task
            worker.process.join(timeout=1.0)
            code = worker.process.exitcode
            if task is not None:
                self._emit(task, 0.0, "error", f"reward worker process died (exit code {code})",
                           time.monotonic() - worker.started_at)
            worker.task = None
            if not worker.ready:
                self._startup_failures += 1
                if self._fatal is None and self._startup_failures >= 3:
                    self._fail_all("reward worker processes keep exiting during start-up "
                                   f"(last exit code {code})")
            if self._fatal is None:
                self._replace(worker)
            else:
                worker.dead = True
            return
        if msg[0] == "ready":
            worker.ready = True
            self._startup_failures = 0
        elif msg[0] == "init_error":
            self._fail_all(f"the reward function failed to load in a worker: {msg[1]}")
        elif msg[0] == "result" and worker.task is not None and msg[1] == worker.task.task_id:
            _, _, reward, status, error, seconds = msg
            task, worker.task = worker.task, None
            self._emit(task, reward, status, error, seconds)

    def _run(self) -> None:
        """Background loop: dispatch, collect, enforce deadlines."""
        while True:
            with self._lock:
                if self._closed:
                    return
                for w in self._workers:
                    while w.ready and w.task is None and self._pending:
                        task = self._pending.popleft()
                        try:
                            w.conn.send((task.task_id, task.completion, task.answer))
                        except OSError:  # died while idle: requeue, the EOF below replaces it
                            self._pending.appendleft(task)
                            w.ready = False
                            break
                        w.task, w.started_at = task, time.monotonic()
                deadlines = [w.started_at + self._timeout_s for w in self._workers if w.task]
                conns = {w.conn: w for w in self._workers if not w.dead}
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            ready = mp_connection.wait([*conns, self._wake_r], timeout=wait_s)
            with self._lock:
                if self._closed:
                    return
                for item in ready:
                    if item == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    elif conns[item] in self._workers:
                        self._handle_message(conns[item])
                now = time.monotonic()
                for w in list(self._workers):
                    if w.task is not None and now >= w.started_at + self._timeout_s:
                        task, w.task = w.task, None
                        self._replace(w)
                        self._emit(task, 0.0, "timeout",
                                   f"reward function ran past timeout_s={self._timeout_s} s; "
                                   "its worker was killed", now - w.started_at)
