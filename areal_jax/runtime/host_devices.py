"""Several XLA:CPU devices in one process (`--xla_force_host_platform_device_count`): the environment such a process
needs before it imports jax. Imports no jax itself.

XLA:CPU sizes its thread pools max(cores, devices) unless PJRT_NPROC says otherwise. A device whose part of a
program reaches a collective (an all-reduce of the gradients, say) first holds its thread until every other device
arrives; when one device has more work before the collective (the blocked attention skips empty blocks, so packed
rows of different fill take different time), the waiting devices and the late one's parallel work can take every
thread of a pool that size, and the collective never completes. On a 2-core machine a program of four devices, one
doing more work before a psum, hung in every one of three runs at the default pool (4 threads), in some at 5-7, and
in none at 8 or more (`tests/test_host_devices.py` runs it); a trainer benchmark on four devices hung once in CI.
`host_device_env` therefore sizes the pools `HEADROOM` threads per device, cores on top; the extra threads sit idle
unless that happens (the trainer's update on four devices measured the same with and without them).
"""
from __future__ import annotations

import os
import re
import sys
from typing import Mapping

HEADROOM = 2  # pool threads per device: the smallest count that never hung in the test above
_COUNT = re.compile(r"\s*--xla_force_host_platform_device_count=\S*")


def pool_threads(devices: int) -> int:
    """PJRT_NPROC for a process of `devices` CPU devices: `HEADROOM` per device plus the machine's cores."""
    return HEADROOM * devices + (os.cpu_count() or 1)


def host_device_env(devices: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set (over `env`, default os.environ) for a process that runs JAX on `devices` CPU devices:
    XLA_FLAGS with the device count (any count already there replaced, other flags kept) and PJRT_NPROC
    (`pool_threads`; a larger value already set is kept). Accelerator backends ignore both."""
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"host devices must be a positive integer, got {devices!r}.")
    env = os.environ if env is None else env
    flags = _COUNT.sub("", env.get("XLA_FLAGS", "")).strip()
    nproc = pool_threads(devices)
    try:
        nproc = max(nproc, int(env.get("PJRT_NPROC", "0")))
    except ValueError:
        raise ValueError(f"PJRT_NPROC={env['PJRT_NPROC']!r} is not an integer; unset it or give a thread count.")
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
            "PJRT_NPROC": str(nproc)}


def use_host_devices(devices: int, *, keep_count: bool = False) -> bool:
    """Set `host_device_env(devices)` in os.environ, for this process's jax. `keep_count`: a device count already
    in XLA_FLAGS wins over `devices` (a caller's explicit choice). Takes effect only before jax's CPU backend
    starts (XLA reads both once); returns whether jax was still unimported."""
    found = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if keep_count and found:
        devices = int(found.group(1))
    os.environ.update(host_device_env(devices))
    return "jax" not in sys.modules
