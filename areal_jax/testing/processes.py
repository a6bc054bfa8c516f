"""Environments for tests that run a program of this checkout in a child process on the CPU."""
from __future__ import annotations

import os

import areal_jax
from areal_jax.runtime.host_devices import host_device_env

# The checkout that holds the package (tests/, benchmarks/ and the configs sit beside it).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(areal_jax.__file__)))


# XLA:CPU aborts the process when a collective's participants (here host devices sharing a few cores with other test
# workers) have not all arrived within 40 s; a loaded 2-core CI machine reached that once. Tests wait longer.
SLOW_HOST_COLLECTIVES = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=120 "
                         "--xla_cpu_collective_call_terminate_timeout_seconds=600")


def cpu_env(devices: int = 1, *, unbuffered: bool = False) -> dict[str, str]:
    """This process's environment for a child that runs JAX on ``devices`` CPU devices (JAX_PLATFORMS=cpu,
    XLA_FLAGS forcing the host device count, PJRT_NPROC sized for it: runtime.host_devices) and imports this checkout first (REPO_ROOT ahead of any
    PYTHONPATH). ``unbuffered``: PYTHONUNBUFFERED=1, so a killed child's log has every line it printed."""
    if devices < 1:
        raise ValueError(f"cpu_env needs at least one device, got devices={devices}.")
    env = dict(os.environ)
    env.update(host_device_env(devices, {"PJRT_NPROC": env.get("PJRT_NPROC", "0")}))
    env["XLA_FLAGS"] += " " + SLOW_HOST_COLLECTIVES
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


def run_benchmark(script: str, *args: str, devices: int = 1, timeout: float = 600) -> tuple[dict, str]:
    """Run ``benchmarks/<script>`` of this checkout with ``args`` in a child process on ``devices`` CPU devices
    (`cpu_env`); assert it exits 0 (showing the end of its stderr otherwise) and return (its last line, the JSON
    every benchmark ends with, parsed; its whole stdout)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", script), *args], capture_output=True,
                         text=True, timeout=timeout, env=cpu_env(devices), cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout
