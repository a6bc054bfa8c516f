"""Test setup: several CPU devices so sharding is exercised on every run.

XLA_FLAGS must be set before jax is imported anywhere, which is why it lives here.
"""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
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

# The test files that take longest (40-160 s each on a 2-core CPU with a cold compile cache, most first) are
# collected first, so that pytest-xdist's two workers (pyproject's addopts: -n 2 --dist loadfile) start on them
# and finish together, instead of one worker running a long file alone at the end. The other files keep their order.
LONGEST_FILES = ("test_update_memory.py", "test_reliability_crash.py", "test_multihost.py", "test_trainer.py",
                 "test_sampler_memory.py", "test_system.py", "test_models.py", "test_trainer_critic.py",
                 "test_benchmark_trainer.py", "test_staleness_ablation.py", "test_scan_layers.py",
                 "test_reliability_soak.py", "test_lora_export.py", "test_code_job.py", "test_paths.py",
                 "test_sampler_fuzz.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))
