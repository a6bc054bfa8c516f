"""What isolation this host gives the sandbox, probed once per process: the ``unshare`` namespaces that work here,
and the kernel layers (``_confinement.py``) that really hold: a Landlock ruleset that refuses a read, a seccomp
filter that refuses a fork. A host (a container, an older kernel) that refuses one gets a sandbox without it, named
by ``sandbox_layers()``, rather than a sandbox that fails every program.
"""
from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys

__all__ = ["namespace_isolation", "landlock_abi", "seccomp_available", "sandbox_layers"]

_UNSHARE_CANDIDATES: tuple[tuple[str, ...], ...] = (
    ("unshare", "--mount", "--net", "--pid", "--fork", "--kill-child"),
    ("unshare", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--kill-child"),
    ("unshare", "--net", "--pid", "--fork", "--kill-child"),
    ("unshare", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"),
    ("unshare", "--net"),
    ("unshare", "--map-root-user", "--net"),
)


@functools.lru_cache(maxsize=None)
def namespace_isolation() -> tuple[str, ...]:
    """The ``unshare`` command prefix that works on this host (mount + network + PID namespaces preferred: a mount
    namespace lets the sandbox put a size-limited tmpfs over its working directory), or () when none does. Probed
    once per process by running ``true`` under each candidate."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return ()
    for prefix in _UNSHARE_CANDIDATES:
        try:
            done = subprocess.run([*prefix, "true"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return prefix
    return ()


_KERNEL_PROBE = """
import json, os, sys, tempfile
namespace = {"__name__": "_confinement"}
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), namespace)
found = {"landlock": 0, "seccomp": False}
abi = namespace["abi_version"]()
if abi > 0:
    try:
        namespace["restrict"](namespace["sandbox_rules"](tempfile.gettempdir(), []), abi)
        os.listdir("/")
    except PermissionError:
        found["landlock"] = abi
    except OSError:
        pass
try:
    if namespace["deny_processes"]():
        os.fork()
except PermissionError:
    found["seccomp"] = True
except OSError:
    pass
print(json.dumps(found))
"""


@functools.lru_cache(maxsize=None)
def _kernel_probe() -> dict:
    """What the kernel enforces here, tried once per process in a probe process: the Landlock ABI whose ruleset
    really refused a read (0: none), and whether a seccomp filter really refused a fork. A host (a container, an
    older kernel) that refuses either gets a sandbox without it rather than one that fails every program."""
    if not sys.platform.startswith("linux"):
        return {"landlock": 0, "seccomp": False}
    from areal_jax.rewards import _confinement

    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _KERNEL_PROBE, _confinement.__file__],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return {"landlock": int(found["landlock"]), "seccomp": bool(found["seccomp"])}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError):
        return {"landlock": 0, "seccomp": False}


def landlock_abi() -> int:
    """This kernel's Landlock ABI version as the sandbox uses it (0: none, or refused here), probed once per process."""
    return _kernel_probe()["landlock"]


def seccomp_available() -> bool:
    """Whether the sandbox filters out new processes with seccomp here (probed once per process)."""
    return _kernel_probe()["seccomp"]


def sandbox_layers() -> str:
    """One line naming the sandbox's layers in force on this host (for a job's log)."""
    prefix = namespace_isolation()
    namespaces = "+".join(n[2:] for n in prefix if n in ("--mount", "--net", "--pid")) or "none"
    disk = "; working directory on a size-limited tmpfs" if "--mount" in prefix else ""
    abi = landlock_abi()
    landlock = (f"Landlock ABI {abi} (files, execve" + (", TCP" if abi >= 4 else "") + (", signals" if abi >= 6 else "")
                + ")") if abi else "no Landlock (file rules rest on the audit hook alone)"
    seccomp = "seccomp (no new processes in test programs)" if seccomp_available() else "no seccomp filter"
    return f"namespaces: {namespaces}{disk}; {landlock}; {seccomp}; resource limits; audit hook"
