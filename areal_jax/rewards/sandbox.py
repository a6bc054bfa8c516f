"""Run untrusted Python from completions in a contained process, and a code-execution reward on top.

Layers of containment, each a backstop for the others:
  * a separate interpreter (``python -I -B -S``: no ``site``, so no ``.pth`` hook of the installation runs; the
    bootstrap puts site-packages on ``sys.path`` itself) in its own session / process group, started by a plain
    fork+exec (no Python code runs between the two, so this is safe from a parent running JAX threads);
  * resource limits the child sets on itself before any untrusted code runs: RLIMIT_CPU (CPU seconds),
    RLIMIT_AS (address space), RLIMIT_FSIZE (bytes per written file), RLIMIT_NPROC (processes; the
    kernel ignores it for root) and no core files;
  * a fresh temporary working directory, deleted afterwards;
  * a seccomp filter (``_confinement.py``) that refuses new processes (fork, a clone that is not a thread, execve,
    ptrace) to a program not allowed them and to every test candidate a harness forks, whatever RLIMIT_NPROC
    (ignored for root) would allow;
  * Landlock, where the kernel has it (Linux >= 5.13, ``_confinement.py``): the kernel itself lets the child read only
    the Python installation, the system's shared libraries and its working directory, write only in its working
    directory, run no program (execve), and (by the kernel's ABI) bind or connect no TCP port and signal no process
    outside the sandbox. Each process the sandboxed code forks for a run or a test case gets one more layer of its
    own (``__sandbox_confine__``), so it cannot trace or signal the process that forked it. Nothing in the process
    can lift these, ctypes included;
  * a ``sys.addaudithook`` hook in the child that denies sockets, process creation and signalling,
    ``ctypes``, raising the resource limits, and file access outside the working directory (reads of
    the Python installation stay allowed so ``import`` works; ``/etc/passwd`` does not). It gives an honest
    program a clear PermissionError, but it is no boundary: pure Python can switch it off (by patching what it
    calls), so the file rules hold against a program that goes looking only where Landlock enforces them;
  * ``unshare`` into new network and PID namespaces when the host allows it (probed once): no network
    interface but a down loopback, and killing the namespace's first process kills every process the
    code started, even ones that left the process group;
  * a wall-clock timeout and an output cap (stdout + stderr), both enforced by SIGKILL to the whole
    process group.

The namespaces, Landlock, the limits and the kills are what hold against a program that bypasses the audit hook.
Without Landlock (an older kernel, or one booted without it: ``landlock_abi() == 0``) nothing but the hook keeps such
a program from the files the reward process can reach; ``sandbox_layers()`` says what is in force, and the code
reward can be told to refuse to run without it (``reward.code_require_landlock``). Run this on machines you own.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from areal_jax.rewards.isolation import landlock_abi, namespace_isolation, sandbox_layers, seccomp_available
from areal_jax.rewards.workdirs import new_workdir, release_workdir

__all__ = ["SandboxResult", "run_python_sandboxed", "extract_python_code", "code_reward",
           "namespace_isolation", "landlock_abi", "sandbox_layers"]

_CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
DISK_MB = 128  # the working directory's size where the sandbox has a mount namespace (a tmpfs: memory)
_CODE_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    status: "ok" (exit code 0), "error" (non-zero exit), "timeout" (wall clock exceeded, killed),
    "output_limit" (stdout + stderr exceeded max_output_bytes, killed) or "stopped" (``stop_when`` said so, killed). exit_code is the process's
    return code (negative: killed by that signal), None if it could not be started.
    stdout / stderr: decoded as UTF-8 with replacement, at most max_output_bytes together.
    """

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    output_truncated: bool
    isolation: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@functools.lru_cache(maxsize=1)
def _install_paths() -> dict[str, str]:
    """This interpreter's stdlib / platstdlib / purelib / platlib directories (what the sandbox may read)."""
    import sysconfig

    paths = sysconfig.get_paths()
    return {key: paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (its session leader's pid is the group id)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def _read_until_done(proc: subprocess.Popen, deadline: float, max_output_bytes: int,
                     stop_when: Callable[[bytes], bool] | None = None
                     ) -> tuple[bytes, bytes, bool, bool, bool]:
    """Drain stdout/stderr until both close, the deadline passes, the output cap is hit or ``stop_when`` (called with
    each new piece of stdout, in order) says enough.

    Returns (stdout, stderr, timed_out, truncated, stopped); kills the process group on timeout, overflow or a stop.
    """
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    total = 0
    with selectors.DefaultSelector() as sel:
        for stream in bufs:
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _kill_group(proc)
                return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), True, False, False
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                room = max_output_bytes - total
                bufs[key.fileobj] += chunk[:room]
                total += len(chunk)
                if total > max_output_bytes:
                    _kill_group(proc)
                    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), False, True, False
                if stop_when is not None and key.fileobj is proc.stdout and stop_when(chunk[:room]):
                    _kill_group(proc)
                    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), False, False, True
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), False, False, False


def _sandbox_command(workdir: str, *, timeout_s: float, memory_mb: int, cpu_time_s: float | None,
                     max_file_bytes: int, max_processes: int, isolate_network: bool, audit_hook: bool,
                     allow_subprocess: bool, allow_numpy: bool, python: str | None, landlock: bool = True,
                     disk_mb: int = 0) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    """(command, environment, namespace prefix) that start the sandbox's bootstrap on ``workdir``/main.py."""
    config = {
        "workdir": workdir,
        "cpu_time_s": int(cpu_time_s if cpu_time_s is not None else math.ceil(timeout_s) + 1),
        "memory_bytes": int(memory_mb) << 20,
        "file_bytes": int(max_file_bytes),
        "max_processes": int(max_processes),
        "audit_hook": bool(audit_hook),
        "allow_subprocess": bool(allow_subprocess),
        "blocked_import_error": bool(allow_numpy),
        "landlock": landlock_abi() if landlock else 0,
        "seccomp": seccomp_available(),
    }
    if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
        config["paths"] = _install_paths()  # the child need not import sysconfig for them
    prefix = namespace_isolation() if isolate_network else ()
    config["disk_bytes"] = int(disk_mb) << 20 if "--mount" in prefix and disk_mb > 0 else 0
    # -S: no site module, so no .pth file runs code at start (the child puts site-packages on sys.path itself)
    cmd = [*prefix, python or sys.executable, "-I", "-B", "-S", _CHILD_SCRIPT, json.dumps(config)]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           # one thread per numerical library: a test runs single-threaded, within its address-space limit
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    layers = (("landlock",) if config["landlock"] else ()) + (
        ("seccomp",) if config["seccomp"] and not allow_subprocess else ())
    return cmd, env, tuple(prefix) + layers


def start_sandboxed(code: str, *, memory_mb: int = 512, cpu_time_s: float = 1e7, max_file_bytes: int = 16 << 20,
                    max_processes: int = 64, isolate_network: bool = True, allow_subprocess: bool = False,
                    allow_numpy: bool = False, landlock: bool = True, disk_mb: int = DISK_MB
                    ) -> tuple[subprocess.Popen, str]:
    """Start ``code`` in the sandbox as ``run_python_sandboxed`` would, but return at once: (the process, with pipes
    for its stdin / stdout / stderr, in a session of its own; its working directory, which the caller removes with
    ``workdirs.release_workdir``). For a
    long-lived sandboxed server (``rewards.zygote``)."""
    workdir = new_workdir()
    cmd, env, _ = _sandbox_command(workdir, timeout_s=1.0, memory_mb=memory_mb, cpu_time_s=cpu_time_s,
                                   max_file_bytes=max_file_bytes, max_processes=max_processes,
                                   isolate_network=isolate_network, audit_hook=True,
                                   allow_subprocess=allow_subprocess, allow_numpy=allow_numpy, python=None,
                                   landlock=landlock, disk_mb=disk_mb)
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                cwd=workdir, env=env, start_new_session=True, close_fds=True)
    except OSError:
        release_workdir(workdir)
        raise
    return proc, workdir


def run_python_sandboxed(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    cpu_time_s: float | None = None,
    max_output_bytes: int = 1 << 20,
    max_file_bytes: int = 16 << 20,
    max_processes: int = 64,
    isolate_network: bool = True,
    audit_hook: bool = True,
    allow_subprocess: bool = False,
    allow_numpy: bool = False,
    python: str | None = None,
    stop_when: Callable[[bytes], bool] | None = None,
    landlock: bool = True,
    disk_mb: int = DISK_MB,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a contained child interpreter and collect its output.

    Args:
      code: Python source text.
      stdin: text fed to the program's standard input.
      timeout_s: wall-clock limit; past it the process group is SIGKILLed and status is "timeout".
      memory_mb: RLIMIT_AS of the child in MiB (allocations beyond it raise MemoryError).
      cpu_time_s: RLIMIT_CPU in seconds; default ceil(timeout_s) + 1.
      max_output_bytes: cap on stdout + stderr together; beyond it the child is killed.
      max_file_bytes: RLIMIT_FSIZE, the largest file the child may write.
      max_processes: RLIMIT_NPROC (ignored by the kernel for root; namespaces and the audit hook cover).
      isolate_network: run under ``unshare`` network (and PID) namespaces when available.
      audit_hook: install the deny-list audit hook (turn off only to test the other layers).
      allow_subprocess: let the audit hook permit fork/exec/kill (still bounded by the other layers: under Landlock
        a forked process may not execve a program).
      allow_numpy: a blocked import (ctypes, cffi) raises ImportError instead of PermissionError, so numpy, which
        only tries ctypes, imports without it. numpy's array interface can then read and write any address of the
        sandboxed process, so a program that goes looking can undo the audit hook's file rules: only the
        namespaces and resource limits still hold it. Off unless a task needs numpy.
      python: interpreter to run; default the current one.
      stop_when: called with each new piece of stdout, in order; True kills the process group and returns what
        was read (status "stopped", e.g. once a test runner's reports settle the outcome).
      landlock: restrict the child with Landlock where the kernel has it (turn off only to compare layers).
      disk_mb: with a mount namespace, the working directory is a tmpfs of this many MiB (all files together; a
        write past it fails with ENOSPC); 0: the host's temporary directory, bounded per file only.
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
        raise ValueError(
            f"run_python_sandboxed needs positive limits, got timeout_s={timeout_s}, "
            f"memory_mb={memory_mb}, max_output_bytes={max_output_bytes}; pass values above zero.")
    workdir = new_workdir()
    cmd, env, prefix = _sandbox_command(workdir, timeout_s=timeout_s, memory_mb=memory_mb, cpu_time_s=cpu_time_s,
                                        max_file_bytes=max_file_bytes, max_processes=max_processes,
                                        isolate_network=isolate_network, audit_hook=audit_hook,
                                        allow_subprocess=allow_subprocess, allow_numpy=allow_numpy, python=python,
                                        landlock=landlock, disk_mb=disk_mb)
    start = time.monotonic()
    proc = None
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            proc = subprocess.Popen(cmd, stdin=stdin_file, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=workdir, env=env,
                                    start_new_session=True, close_fds=True)
        out, err, timed_out, truncated, stopped = _read_until_done(
            proc, start + timeout_s, max_output_bytes, stop_when)
        try:
            proc.wait(timeout=max(0.0, start + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)  # leftovers that closed their pipes but kept running
        proc.wait()
        if timed_out:
            status = "timeout"
        elif truncated:
            status = "output_limit"
        elif stopped:
            status = "stopped"
        else:
            status = "ok" if proc.returncode == 0 else "error"
        return SandboxResult(status, proc.returncode, out.decode("utf-8", "replace"),
                             err.decode("utf-8", "replace"), time.monotonic() - start,
                             timed_out, truncated, tuple(prefix))
    except OSError as e:
        return SandboxResult("error", None, "", f"sandbox could not start the program: {e}",
                             time.monotonic() - start, False, False, tuple(prefix))
    finally:
        if proc is not None:
            _kill_group(proc)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            if proc.returncode is None:
                proc.wait()
        release_workdir(workdir)


def extract_python_code(completion: str) -> str | None:
    """Body of the last fenced code block tagged python/py/python3, else of the last fenced block
    of any tag, else None."""
    blocks = _CODE_BLOCK.findall(completion)
    if not blocks:
        return None
    tagged = [body for tag, body in blocks if tag.lower() in ("python", "py", "python3")]
    return (tagged or [body for _, body in blocks])[-1]


def code_reward(completion: str, tests: str | Sequence[str], *, timeout_s: float = 10.0,
                memory_mb: int = 512) -> float:
    """1.0 iff the completion's last Python block, followed by ``tests`` (assert statements; a list
    is joined by newlines), exits with code 0 inside the sandbox within the limits; else 0.0.
    Never raises."""
    try:
        code = extract_python_code(completion)
        if code is None:
            return 0.0
        test_src = tests if isinstance(tests, str) else "\n".join(tests)
        result = run_python_sandboxed(f"{code}\n\n{test_src}\n", timeout_s=timeout_s,
                                      memory_mb=memory_mb)
        return 1.0 if result.ok else 0.0
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        return 0.0
