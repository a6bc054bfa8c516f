"""Multi-process start-up with JAX's own runtime (`jax.distributed`), and a peer watchdog.

Where the coordinates come from, first match wins:
  1. the config: distributed.coordinator_address / num_processes / process_id;
  2. the environment of our launchers: AREAL_COORDINATOR, AREAL_NUM_PROCESSES, AREAL_PROCESS_ID;
  3. SLURM (srun sets SLURM_* variables) and Cloud TPU pods: `jax.distributed.initialize()` with no
     arguments detects both on its own.
A single process with none of these runs without jax.distributed at all.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import jax

ENV_COORDINATOR = "AREAL_COORDINATOR"
ENV_NUM_PROCESSES = "AREAL_NUM_PROCESSES"
ENV_PROCESS_ID = "AREAL_PROCESS_ID"


def is_primary() -> bool:
    """True on process 0: the only one that writes logs, plots and summaries."""
    return jax.process_index() == 0


def _detect_cluster() -> str | None:
    if "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    if os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("CLOUD_TPU_TASK_ID"):
        return "tpu"
    return None


def initialize(config: Any | None = None) -> dict:
    """Call jax.distributed.initialize when this run spans several processes; returns what was used.

    Must run before anything touches a JAX device. CPU runs (tests, the local launcher) get gloo
    collectives so cross-process computations work without accelerators.
    """
    d = getattr(config, "distributed", None)
    address = (d.coordinator_address if d is not None else "") or os.environ.get(ENV_COORDINATOR, "")
    num = (d.num_processes if d is not None else None) or os.environ.get(ENV_NUM_PROCESSES)
    pid = d.process_id if d is not None and d.process_id is not None else os.environ.get(ENV_PROCESS_ID)
    enabled = bool(d is not None and d.enabled)
    cluster = _detect_cluster()
    if not (address or enabled or cluster):
        return {"mode": "single"}
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or jax.config.jax_platforms == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if address:
        if num is None or pid is None:
            raise ValueError(
                f"distributed coordinator address {address!r} is set but the process count or id is not: "
                f"set distributed.num_processes and distributed.process_id (or {ENV_NUM_PROCESSES} and "
                f"{ENV_PROCESS_ID})."
            )
        kwargs = dict(coordinator_address=address, num_processes=int(num), process_id=int(pid))
    jax.distributed.initialize(**kwargs)
    return {"mode": cluster or "explicit", "process_index": jax.process_index(),
            "process_count": jax.process_count()}


class PeerWatchdog:
    """Ends this process when a peer stops answering, instead of hanging in a collective forever.

    Every process writes a heartbeat file `<dir>/hb.<process_id>` every `interval_s`; a daemon thread
    checks the others. If one has not beaten for `timeout_s` (it crashed, was killed, or hangs), this
    process reports it and calls `on_dead` (default: os._exit(3)), since a collective with a dead peer
    would otherwise block forever. A shared directory works on one host and on clusters with a shared
    filesystem; processes that finished cleanly write `hb.<id>.done` and are not waited for.
    """

    def __init__(self, directory: str, process_id: int, num_processes: int, *, interval_s: float = 2.0,
                 timeout_s: float = 30.0, on_dead: Callable[[str], None] | None = None):
        self.dir, self.pid, self.n = directory, process_id, num_processes
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.on_dead = on_dead or self._exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        os.makedirs(directory, exist_ok=True)

    @staticmethod
    def _exit(msg: str) -> None:
        print(msg, flush=True)
        os._exit(3)

    def _path(self, pid: int) -> str:
        return os.path.join(self.dir, f"hb.{pid}")

    def beat(self) -> None:
        with open(self._path(self.pid), "w") as f:
            f.write(str(time.time()))

    def start(self) -> "PeerWatchdog":
        self.beat()
        started = time.time()

        def loop():
            while not self._stop.wait(self.interval_s):
                self.beat()
                now = time.time()
                for other in range(self.n):
                    if other == self.pid or os.path.exists(self._path(other) + ".done"):
                        continue
                    try:
                        last = os.path.getmtime(self._path(other))
                    except FileNotFoundError:
                        last = started
                    if now - last > self.timeout_s:
                        self.on_dead(
                            f"process {other} has not sent a heartbeat for {now - last:.0f} s "
                            f"(limit {self.timeout_s:.0f} s); it died or hangs, so process {self.pid} exits "
                            "instead of waiting in a collective forever."
                        )
                        return

        self._thread = threading.Thread(target=loop, name="peer-watchdog", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> None:
        """Mark this process as cleanly finished and stop beating."""
        self._stop.set()
        with open(self._path(self.pid) + ".done", "w") as f:
            f.write(str(time.time()))
