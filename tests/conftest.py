"""Test setup: several CPU devices so sharding is exercised on every run.

XLA_FLAGS must be set before jax is imported anywhere, which is why it lives here.
"""
import os

from areal_jax.runtime.host_devices import use_host_devices  # (imports no jax)

use_host_devices(4, keep_count=True)  # four devices unless XLA_FLAGS names a count; pools that fit their collectives
if "xla_cpu_collective_call_terminate_timeout_seconds" not in os.environ["XLA_FLAGS"]:
    from areal_jax.testing.processes import SLOW_HOST_COLLECTIVES  # (imports no jax)

    os.environ["XLA_FLAGS"] += " " + SLOW_HOST_COLLECTIVES
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Share compiled XLA programs across tests and the subprocesses they start (same tiny models compile
# the same programs many times otherwise); main.run reads the same variable.
os.environ.setdefault("AREAL_JAX_COMPILE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "areal_jax", "xla-tests"))
jax.config.update("jax_compilation_cache_dir", os.environ["AREAL_JAX_COMPILE_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
