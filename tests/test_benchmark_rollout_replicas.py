"""benchmarks/rollout_replicas.py at toy size, in its own process (it sets the host device count before JAX starts):
every layout generates the same forced tokens, and only the replicas' decode step moves nothing between devices."""
from __future__ import annotations

import pytest

from areal_jax.testing.processes import run_benchmark


@pytest.mark.long  # 23-35 s in CI; the replicas themselves are tested in tests/test_sampler_replicas.py
def test_the_replica_benchmark_reports_every_layout_and_no_traffic_for_replicas():
    line, _ = run_benchmark("rollout_replicas.py", "--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
                            "--intermediate", "128", "--vocab", "256", "--slots", "4", "--requests", "6", "--median",
                            "8", "--cap", "16", devices=2)
    assert line["benchmark"] == "rollout_replicas" and line["devices"] == 2
    res = line["results"]
    assert set(res) == {"fsdp", "tensor", "replicas"}
    assert len({r["generated_tokens"] for r in res.values()}) == 1  # the same forced lengths everywhere
    assert res["replicas"]["collectives"] == 0 and res["replicas"]["collective_bytes"] == 0
    assert res["fsdp"]["collective_bytes"] > 0 and res["tensor"]["collective_bytes"] > 0
    assert (res["replicas"]["engines"], res["replicas"]["slots_per_engine"]) == (2, 2)
    for other in ("fsdp", "tensor"):
        assert line[f"speedup_vs_{other}"] == res["replicas"]["tokens_per_s"] / res[other]["tokens_per_s"]
