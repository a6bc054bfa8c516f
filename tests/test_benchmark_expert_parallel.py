"""benchmarks/expert_parallel.py at its small preset, in its own process (it sets its host device count): the three
layouts compile, expert parallelism keeps each device's experts whole and moves no expert weights, the ring moves
rows only between neighbours ((5n - 3) / (4n - 4) of the all-gather's bytes) and its temporaries do not grow with the
fsdp size, and the three programs run to the same outputs and gradients."""
from __future__ import annotations

import pytest

from areal_jax.testing.processes import run_benchmark


@pytest.mark.long  # 23-33 s in CI; expert parallelism itself is tested in tests/test_expert_parallel.py
def test_the_expert_parallel_benchmark_compares_both_layouts_on_the_same_work():
    line, _ = run_benchmark("expert_parallel.py", "--preset", "small", "--devices", "4", "--tokens", "512", "--run",
                            "--sweep", "2,4")
    assert line["benchmark"] == "expert_parallel" and line["devices"] == 4 and line["preset"] == "small"
    fsdp, ep = line["results"]["fsdp"], line["results"]["expert_parallel"]
    assert fsdp["expert_spec"] == "P(None, 'fsdp', None)" and ep["expert_spec"] == "P('fsdp', None, None)"
    assert fsdp["argument_bytes"] == ep["argument_bytes"]  # the same weights per device, split the other way
    assert "reduce-scatter" in ep["wire_bytes"] and ep["wire_total"] < fsdp["wire_total"]
    assert line["moved_ratio"] == ep["wire_total"] / fsdp["wire_total"]
    ring = line["results"]["ring"]
    assert ring["expert_spec"] == ep["expert_spec"] and ring["argument_bytes"] == ep["argument_bytes"]
    permuted = ring["wire_bytes"]["collective-permute"]  # every step of the loops counted: rows, weights, picks
    assert abs(permuted / (ep["wire_bytes"]["all-gather"] + ep["wire_bytes"]["reduce-scatter"]) - 17 / 12) < 0.03
    assert ring["wire_bytes"].get("all-gather", 0) < permuted / 100  # (the router's own FSDP gather only)
    assert line["ring_moved_ratio"] == ring["wire_total"] / fsdp["wire_total"]
    sweep = line["sweep"]  # the same tokens a device on 2 and 4 devices
    assert sweep["4"]["expert_parallel"] > sweep["2"]["expert_parallel"]  # twice the gathered rows
    assert sweep["4"]["ring"] <= sweep["2"]["ring"] and sweep["4"]["ring"] < sweep["4"]["expert_parallel"]
    assert line["run"]["max_rel_diff"] < 1e-4 and set(line["run"]["step_s"]) == {"fsdp", "expert_parallel", "ring"}
