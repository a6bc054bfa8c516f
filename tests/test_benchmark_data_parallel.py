"""benchmarks/data_parallel.py at toy size, in its own process (it sets XLA's dump flags before JAX starts): the
JSON line holds both runs' collective bytes, and the mesh context cuts the activation bytes that cross devices; with
--moe, expert parallelism moves rows instead of expert weights."""
from __future__ import annotations

import pytest

from areal_jax.testing.processes import run_benchmark


@pytest.mark.long  # 20 s in CI; the mesh context itself is tested in tests/test_batch_sharding.py
def test_the_data_parallel_benchmark_reports_fewer_activation_bytes_with_the_mesh_context():
    line, _ = run_benchmark("data_parallel.py", "--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
                            "--intermediate", "128", "--vocab", "256", "--trajectories", "8", "--max-len", "64",
                            "--micro-batch-tokens", "128", "--repeats", "1")  # it sets its own device count
    assert line["benchmark"] == "data_parallel" and line["devices"] == 4
    without, with_ = (line["results"][k]["bytes"] for k in ("without", "with"))
    assert sum(with_["weights"].values()) > 0  # FSDP: weights are gathered to each device
    activations = {k: sum(v["activations"].values()) for k, v in (("without", without), ("with", with_))}
    assert activations["without"] > 4 * activations["with"]
    assert line["activation_bytes_ratio"] == activations["without"] / max(activations["with"], 1)
    assert set(with_["activations"]) <= {"all-to-all", "all-gather"}  # the embedding rows, an int gather


@pytest.mark.long  # (excluded from the default run: `-m long`)
def test_with_moe_it_also_reports_expert_parallelism_against_fsdp_experts():
    line, _ = run_benchmark("data_parallel.py", "--moe", "--hidden", "64", "--layers", "1", "--heads", "4",
                            "--kv-heads", "2", "--intermediate", "512", "--vocab", "256", "--trajectories", "8",
                            "--max-len", "64", "--micro-batch-tokens", "128", "--repeats", "1")
    fsdp, ep = (line["results"][k]["bytes"] for k in ("with", "with, expert parallel"))
    # each device keeps 2 of the 8 experts: their weights stop moving, the tokens' rows move instead
    assert sum(ep["weights"].values()) < sum(fsdp["weights"].values())
    assert "reduce-scatter" in ep["activations"] and "reduce-scatter" not in fsdp["activations"]
    moved = {k: sum(sum(b[c].values()) for c in ("weights", "activations")) for k, b in (("fsdp", fsdp), ("ep", ep))}
    assert line["expert_parallel_bytes_ratio"] == moved["ep"] / moved["fsdp"] and line["expert_parallel_speedup"] > 0
