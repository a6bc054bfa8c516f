"""runtime.host_devices: the environment of a process with several XLA:CPU devices, and the collective that hung
without it (one device doing more work before a psum than the others)."""
import subprocess
import sys

import numpy as np
import pytest

from areal_jax.runtime import host_devices
from areal_jax.testing.processes import cpu_env

UNEVEN_PSUM = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

n, rounds = jax.device_count(), int(sys.argv[1])
mesh = Mesh(np.array(jax.devices()), ("d",))

def body(x):  # the last device runs 20 products before the psums, the others one
    steps = jnp.where(jax.lax.axis_index("d") == n - 1, 20, 1)
    y = jax.lax.fori_loop(0, steps, lambda _, c: jnp.tanh(c @ c), x[0])
    return jax.lax.psum(y, "d")[None], jax.lax.psum(jnp.ones(1), "d")

f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))))
x0 = np.stack([np.full((512, 512), 0.002 * (i + 1), np.float32) for i in range(n)])
x, arrived = jax.device_put(jnp.asarray(x0), NamedSharding(mesh, P("d"))), 0.0
for _ in range(rounds):
    y, count = f(x)
    x, arrived = y * 0.01, arrived + count
np.savez(sys.argv[2], x=np.asarray(x), arrived=np.asarray(arrived))
"""


def reference(n: int, rounds: int) -> np.ndarray:
    """The program's x, worked on scalars: every matrix stays constant, c @ c of a constant c being 512 c^2."""
    vals = [0.002 * (i + 1) for i in range(n)]
    for _ in range(rounds):
        total = 0.0
        for i, c in enumerate(vals):
            for _ in range(20 if i == n - 1 else 1):
                c = np.tanh(512 * c * c)
            total += c
        vals = [total * 0.01] * n
    return np.stack([np.full((512, 512), v) for v in vals])


def test_env_sets_the_count_and_sizes_the_pools():
    env = host_devices.host_device_env(
        4, {"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8 --xla_cpu_foo=1"})
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    cores = host_devices.os.cpu_count()
    assert env["PJRT_NPROC"] == str(2 * 4 + cores) == str(host_devices.pool_threads(4))
    # A larger pool already asked for is kept; a smaller one is raised.
    assert host_devices.host_device_env(2, {"PJRT_NPROC": "64"})["PJRT_NPROC"] == "64"
    assert host_devices.host_device_env(2, {"PJRT_NPROC": "1"})["PJRT_NPROC"] == str(4 + cores)
    assert host_devices.host_device_env(1, {}) == {"XLA_FLAGS": "--xla_force_host_platform_device_count=1",
                                                   "PJRT_NPROC": str(2 + cores)}
    with pytest.raises(ValueError, match="PJRT_NPROC='many' is not an integer"):
        host_devices.host_device_env(2, {"PJRT_NPROC": "many"})
    for bad in (0, -1, 2.0, "4"):
        with pytest.raises(ValueError, match="positive integer"):
            host_devices.host_device_env(bad, {})


def test_use_host_devices_keeps_a_count_the_caller_chose(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    assert host_devices.use_host_devices(4, keep_count=True) is False  # jax is imported in this process already
    assert host_devices.os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert host_devices.os.environ["PJRT_NPROC"] == str(host_devices.pool_threads(2))
    host_devices.use_host_devices(4)
    assert host_devices.os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


@pytest.mark.parametrize("devices", [4, 8])
def test_a_psum_after_uneven_work_completes(tmp_path, devices):
    """At XLA's default pool (max(cores, devices) threads) this program (40 rounds) hung in three runs of three on a
    2-core machine; at the pool cpu_env gives, it completes with the values worked by hand."""
    rounds = 40
    env = cpu_env(devices)
    assert env["PJRT_NPROC"] == str(host_devices.pool_threads(devices))
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("terminate_timeout_seconds=600",
                                                "terminate_timeout_seconds=60")  # a hang aborts at 60 s rather than the test's limit
    script, out = tmp_path / "uneven_psum.py", tmp_path / "out.npz"
    script.write_text(UNEVEN_PSUM)
    proc = subprocess.run([sys.executable, str(script), str(rounds), str(out)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    np.testing.assert_array_equal(got["arrived"], np.full(devices, devices * rounds))  # every psum had every device
    np.testing.assert_allclose(got["x"], reference(devices, rounds), rtol=1e-4, atol=1e-12)
