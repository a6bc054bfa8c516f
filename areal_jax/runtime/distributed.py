"""Multi-process start-up with JAX's own runtime (`jax.distributed`), and a peer watchdog.

Where the coordinates come from, first match wins:
  1. the config: distributed.coordinator_address / num_processes / process_id;
  2. the environment of our launchers: AREAL_COORDINATOR, AREAL_NUM_PROCESSES, AREAL_PROCESS_ID;
  3. SLURM (srun sets SLURM_* variables) and Cloud TPU pods: `jax.distributed.initialize()` with no
     arguments detects both on its own.
A single process with none of these runs without jax.distributed at all.

Peer failures are detected by JAX's coordination service (it runs inside process 0): every process's
runtime sends it heartbeats over the same gRPC connection the processes found each other through, and
when one stops for `distributed.heartbeat_timeout_s` (killed, crashed, frozen, host gone), the service
reports "Task <i> heartbeat timeout" / "tasks are unhealthy (stopped sending heartbeats): <i>" to every
other process, whose runtime then terminates it (non-zero exit, the message on stderr). When process 0
itself dies, the others' heartbeats fail and they terminate the same way, naming the leader task. No
file, and so no shared filesystem, is involved, and nothing depends on the processes sharing a host
(tests/test_multihost.py exercises it with two processes on one host).

`PeerWatchdog` (optional, `distributed.file_heartbeats=True`) adds heartbeat files under
`<run_dir>/heartbeats`, written by a Python thread. What it still adds: it notices a process whose
Python interpreter is stuck (a C extension holding the GIL) while its runtime threads keep answering
the coordination service, and its message is in this project's words. It needs a run directory every
process can see (one host, or a shared filesystem).
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import Any, Callable, ClassVar

import jax

from areal_jax.knobs import Section, knob, require

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


def heartbeat_timeout_seconds(config: Any | None) -> int:
    """The coordination service's missing-heartbeat limit (whole seconds, at least 1) from
    distributed.heartbeat_timeout_s."""
    d = getattr(config, "distributed", None)
    timeout = float(d.heartbeat_timeout_s) if d is not None else 60.0
    return max(1, math.ceil(timeout))


def initialize(config: Any | None = None) -> dict:
    """Call jax.distributed.initialize when this run spans several processes; returns what was used.

    Must run before anything touches a JAX device. CPU runs (tests, the local launcher) get gloo
    collectives so cross-process computations work without accelerators. The coordination service's
    heartbeat timeout comes from distributed.heartbeat_timeout_s (see the module docstring).
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
                f"set --config.distributed.num_processes=N and --config.distributed.process_id=I (or "
                f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID})."
            )
        kwargs = dict(coordinator_address=address, num_processes=int(num), process_id=int(pid))
    heartbeat = heartbeat_timeout_seconds(config)
    jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=heartbeat)
    return {"mode": cluster or "explicit", "process_index": jax.process_index(),
            "process_count": jax.process_count(), "heartbeat_timeout_s": heartbeat}


_STATUS_CODES = ("UNKNOWN", "INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED",
                 "FAILED_PRECONDITION", "DATA_LOSS")


def is_runtime_failure(error: BaseException) -> bool:
    """True for an error raised by the XLA runtime (a collective or transfer failed): its message starts
    with a status code such as "UNKNOWN:" or "UNAVAILABLE:"; False for this program's own errors."""
    message = str(error).lstrip()
    return isinstance(error, Exception) and message.split(":", 1)[0] in _STATUS_CODES


def await_peer_verdict(timeout_s: float, *, poll_s: float = 0.5) -> None:
    """After this process failed in a multi-process run: give JAX's coordination service up to
    `timeout_s` to name a peer that died (it then terminates this process with a message naming the
    task), and return if it does not (the failure was this process's own).

    A collective whose peer died fails here with the transport's error (e.g. gloo's "Connection reset
    by peer"), which names an address, not a process; waiting one heartbeat window lets the service say
    which process it was. Call with stdout / stderr flushed; the caller exits afterwards.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)


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


@dataclasses.dataclass(frozen=True)
class DistributedConfig(Section):
    """Several processes (hosts) in one job (the config's `distributed` section)."""

    section: ClassVar[str] = "distributed"

    enabled: bool = knob(False, "call jax.distributed.initialize; also turned on by a coordinator address or "
                         "SLURM / TPU env")
    coordinator_address: str = knob("", "host:port of process 0's coordination service")
    num_processes: int | None = knob(None, "processes in the job (None: from the environment)")
    process_id: int | None = knob(None, "this process's index (None: from the environment)")
    heartbeat_timeout_s: float = knob(60.0, "seconds without a heartbeat before a process counts as dead")
    file_heartbeats: bool = knob(False, "also heartbeat files under <run_dir>/heartbeats (needs a shared local "
                                 "run_dir)")

    def check(self) -> None:
        require(self.heartbeat_timeout_s >= 1,
                f"{self.key('heartbeat_timeout_s')}={self.heartbeat_timeout_s} must be at least 1 (seconds without "
                "a heartbeat before a process counts as dead), e.g. --config.distributed.heartbeat_timeout_s=60.")
