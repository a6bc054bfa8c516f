"""benchmarks/router_replay.py at toy size, in its own process: the sampler's routes agree with a trainer holding
the same weights far more than with a perturbed one, and replaying them brings the trainer's log-probs of the sampled
tokens closer to the sampler's for both."""
from __future__ import annotations

import pytest

from areal_jax.testing.processes import run_benchmark


@pytest.mark.long  # 28-41 s in CI; tests/test_router_replay.py checks replay itself
def test_the_replay_benchmark_reports_agreement_gaps_and_cost():
    line, _ = run_benchmark("router_replay.py", "--hidden", "64", "--layers", "2", "--experts", "4", "--vocab", "128",
                            "--requests", "8", "--new-tokens", "12", "--cap", "24", "--slots", "8", "--repeats", "1")
    assert line["benchmark"] == "router_replay" and 8 <= line["tokens"] <= 8 * 24
    fresh, stale = line["results"]["fresh"], line["results"]["stale"]
    assert 0.9 < fresh["route_agreement"] <= 1.0 and stale["route_agreement"] < fresh["route_agreement"]
    for row in (fresh, stale):
        assert row["replay"]["max_abs_logp_gap"] <= row["off"]["max_abs_logp_gap"] + 1e-6
    assert line["tokens_per_s_with_routes"] > 0 and line["tokens_per_s_without_routes"] > 0
