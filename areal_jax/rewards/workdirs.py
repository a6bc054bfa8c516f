"""Sandbox working directories that do not outlive their owner for long.

Each sandbox (a fresh sandboxed interpreter, a zygote) works in a directory of its own under the temporary
directory, removed when it ends. A reward worker killed at a sample's time limit (or a job killed outright) never
gets to remove it, and a long code-RL run kills many workers. So each directory has a sibling lock file that its
owning process holds (``flock``) for as long as the directory is in use, and every process that starts sandboxes
sweeps (at its first, then at most every five minutes) the directories whose lock nobody holds any more: the kernel releases a lock when its holder dies,
whatever killed it, and the same works across PID namespaces sharing the directory. A lock younger than a minute is
left alone (its owner may be between creating and locking it).
"""
from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
import time

__all__ = ["new_workdir", "release_workdir", "sweep_abandoned_workdirs", "PREFIX"]

PREFIX = "areal_sandbox_"
_MIN_AGE_S = 60.0
_SWEEP_EVERY_S = 300.0
_last_sweep = [float("-inf")]
_held: dict[str, int] = {}  # workdir -> the descriptor holding its lock, in this process


def new_workdir() -> str:
    """A fresh private directory for one sandbox, its lock held by this process until ``release_workdir``."""
    if time.monotonic() - _last_sweep[0] >= _SWEEP_EVERY_S:
        _last_sweep[0] = time.monotonic()
        sweep_abandoned_workdirs()
    workdir = tempfile.mkdtemp(prefix=PREFIX)
    fd = os.open(workdir + ".lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held[workdir] = fd
    return workdir


def release_workdir(workdir: str) -> None:
    """Remove the directory and its lock (idempotent)."""
    shutil.rmtree(workdir, ignore_errors=True)
    fd = _held.pop(workdir, None)
    try:
        os.unlink(workdir + ".lock")
    except OSError:
        pass
    if fd is not None:
        os.close(fd)


def sweep_abandoned_workdirs(root: str | None = None) -> int:
    """Remove the sandbox directories under ``root`` (default: the temporary directory) whose lock no process holds
    and is older than a minute. Returns how many it removed."""
    removed = 0
    for lock in glob.glob(os.path.join(root or tempfile.gettempdir(), PREFIX + "*.lock")):
        try:
            if time.time() - os.stat(lock).st_mtime < _MIN_AGE_S:
                continue
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner is alive
            os.close(fd)
            continue
        shutil.rmtree(lock[: -len(".lock")], ignore_errors=True)
        try:
            os.unlink(lock)
        except OSError:
            pass
        os.close(fd)
        removed += 1
    return removed
