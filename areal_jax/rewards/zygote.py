"""Sandboxed runs forked from a long-lived sandboxed process instead of started one by one.

``run_python_sandboxed`` starts a new contained interpreter per run: about 30 ms of namespaces, interpreter start and
bootstrap before the program's first line. The code reward runs one or two sandboxed programs per sample (a test
harness), so that start is most of a short sample's cost. ``SandboxZygote`` starts one sandboxed process
(``_sandbox_zygote.py``, the same bootstrap, namespaces, limits and audit hook) that never runs untrusted code itself
and forks a fresh run process per request, in a fresh directory: each run starts from the same pristine state, as a
new interpreter would, in about a millisecond.

``run_forked(...)`` has ``run_python_sandboxed``'s arguments and result; each thread of each process keeps one zygote
per sandbox configuration (memory limit, numpy), started on first use and started again if it dies or stops answering.
"""
from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import subprocess
import threading
import time
from typing import Callable

from areal_jax.rewards.isolation import landlock_abi
from areal_jax.rewards.sandbox import DISK_MB, SandboxResult, start_sandboxed
from areal_jax.rewards.workdirs import release_workdir

_HERE = os.path.dirname(os.path.abspath(__file__))
_ZYGOTE_PATH = os.path.join(_HERE, "_sandbox_zygote.py")


@functools.lru_cache(maxsize=None)
def sandbox_source(path: str) -> str:
    """The source of a program that runs inside the sandbox (a test harness, the zygote), with ``_fork_run.py``'s
    shared functions in front of it."""
    parts = []
    for name in (os.path.join(_HERE, "_fork_run.py"), path):
        with open(name, encoding="utf-8") as f:
            parts.append(f.read())
    return "\n\n".join(parts)
_GRACE_S = 2.0  # beyond a run's own limit, how long the zygote may take to report it before it is replaced


class ZygoteError(RuntimeError):
    """The zygote died or stopped answering (it is replaced; the run did not happen)."""


class SandboxZygote:
    """One long-lived sandboxed process that forks a sandboxed run per ``run`` call (one at a time)."""

    def __init__(self, *, memory_mb: int = 512, allow_numpy: bool = False, isolate_network: bool = True,
                 landlock: bool = True, disk_mb: int = DISK_MB) -> None:
        self.disk_mb = int(disk_mb)
        self.memory_mb, self.allow_numpy, self.isolate_network = int(memory_mb), bool(allow_numpy), isolate_network
        self.isolation = ("zygote", "landlock") if landlock and landlock_abi() else ("zygote",)
        self._proc: subprocess.Popen | None = None
        self._next_id = 0
        self._buffer = bytearray()
        self._start()

    def _start(self) -> None:
        self._proc, self._workdir = start_sandboxed(sandbox_source(_ZYGOTE_PATH), memory_mb=self.memory_mb,
                                                    isolate_network=self.isolate_network, allow_subprocess=True,
                                                    allow_numpy=self.allow_numpy, landlock="landlock" in self.isolation,
                                                    disk_mb=self.disk_mb)
        os.set_blocking(self._proc.stdout.fileno(), False)
        self._buffer = bytearray()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Kill the zygote and whatever it runs; remove its directory."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

        release_workdir(self._workdir)

    def _send(self, record: dict) -> None:
        self._proc.stdin.write((json.dumps(record) + "\n").encode())
        self._proc.stdin.flush()

    def _replies(self, deadline: float):
        """Yield the zygote's reply records until ``deadline``; ZygoteError when it dies or the deadline passes."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            while True:
                while b"\n" in self._buffer:
                    line, _, rest = bytes(self._buffer).partition(b"\n")
                    self._buffer[:] = rest
                    yield json.loads(line)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ZygoteError("the sandbox zygote stopped answering")
                if sel.select(timeout=min(remaining, 1.0)):
                    try:
                        chunk = os.read(self._proc.stdout.fileno(), 1 << 16)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        raise ZygoteError("the sandbox zygote exited")
                    self._buffer.extend(chunk)

    def run(self, code: str, *, stdin: str = "", timeout_s: float = 10.0, max_output_bytes: int = 1 << 20,
            stop_when: Callable[[bytes], bool] | None = None, allow_subprocess: bool = True) -> SandboxResult:
        """``code`` as ``__main__`` in a run process forked from the zygote (see the module doc); ZygoteError
        (after which this zygote is closed) when the zygote itself fails. ``allow_subprocess=False``: the run may
        create no process (the seccomp filter, where the sandbox has it), as a program run by itself should."""
        if not self.alive:
            raise ZygoteError("the sandbox zygote is not running")
        self._next_id += 1
        rid, start = self._next_id, time.monotonic()
        out = bytearray()
        stop_sent = False
        try:
            self._send({"op": "run", "id": rid, "source": code, "stdin": stdin, "timeout_s": float(timeout_s),
                        "max_output_bytes": int(max_output_bytes), "processes": bool(allow_subprocess)})
            for record in self._replies(start + timeout_s + _GRACE_S):
                if record.get("id") != rid:
                    continue  # a late reply of an earlier run
                if "out" in record:
                    piece = record["out"].encode("latin-1")
                    out.extend(piece)
                    if stop_when is not None and not stop_sent and stop_when(piece):
                        self._send({"op": "stop", "id": rid})
                        stop_sent = True
                    continue
                status = record.get("status", "error")
                return SandboxResult(status, record.get("exit_code"), out.decode("utf-8", "replace"),
                                     str(record.get("stderr", "")), time.monotonic() - start, status == "timeout",
                                     status == "output_limit", self.isolation)
        except (ZygoteError, OSError, ValueError) as e:
            self.close()
            raise ZygoteError(str(e)) from e
        raise ZygoteError("the sandbox zygote ended its replies")  # unreachable: _replies raises first


_LOCAL = threading.local()


def run_forked(code: str, *, stdin: str = "", timeout_s: float = 10.0, memory_mb: int = 512,
               max_output_bytes: int = 1 << 20, allow_numpy: bool = False,
               stop_when: Callable[[bytes], bool] | None = None, allow_subprocess: bool = True) -> SandboxResult:
    """``run_python_sandboxed(code, ..., allow_subprocess=...)`` through this thread's zygote for the configuration
    (started on first use; a harness that forks its candidates needs processes, a program run by itself should get
    ``allow_subprocess=False``). If the zygote fails it is replaced and the run goes to a new one once; a run that
    itself times out, errs or overflows is a result, not a failure."""
    zygotes = getattr(_LOCAL, "zygotes", None)
    if zygotes is None or getattr(_LOCAL, "pid", None) != os.getpid():  # a forked process starts its own
        zygotes = _LOCAL.zygotes = {}
        _LOCAL.pid = os.getpid()
    key = (int(memory_mb), bool(allow_numpy))
    for attempt in range(2):
        zygote = zygotes.get(key)
        if zygote is None or not zygote.alive:
            zygote = zygotes[key] = SandboxZygote(memory_mb=memory_mb, allow_numpy=allow_numpy)
        try:
            return zygote.run(code, stdin=stdin, timeout_s=timeout_s, max_output_bytes=max_output_bytes,
                              stop_when=stop_when, allow_subprocess=allow_subprocess)
        except ZygoteError:
            zygotes.pop(key, None)
            if attempt:
                raise
    raise AssertionError("unreachable")


def close_all() -> None:
    """Close this thread's zygotes (each is also killed with its process group when the process exits)."""
    for zygote in getattr(_LOCAL, "zygotes", {}).values():
        zygote.close()
    _LOCAL.zygotes = {}
