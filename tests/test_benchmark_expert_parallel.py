"""benchmarks/expert_parallel.py at its small preset, in its own process (it sets its host device count): both ways of
holding the experts compile, expert parallelism keeps each device's experts whole and moves no expert weights, and
the two programs run to the same outputs and gradients."""
from __future__ import annotations

from areal_jax.testing.processes import run_benchmark


def test_the_expert_parallel_benchmark_compares_both_layouts_on_the_same_work():
    line, _ = run_benchmark("expert_parallel.py", "--preset", "small", "--devices", "4", "--tokens", "512", "--run")
    assert line["benchmark"] == "expert_parallel" and line["devices"] == 4 and line["preset"] == "small"
    fsdp, ep = line["results"]["fsdp"], line["results"]["expert_parallel"]
    assert fsdp["expert_spec"] == "P(None, 'fsdp', None)" and ep["expert_spec"] == "P('fsdp', None, None)"
    assert fsdp["argument_bytes"] == ep["argument_bytes"]  # the same weights per device, split the other way
    assert "reduce-scatter" in ep["wire_bytes"] and ep["wire_total"] < fsdp["wire_total"]
    assert line["moved_ratio"] == ep["wire_total"] / fsdp["wire_total"]
    assert line["run"]["max_rel_diff"] < 1e-4 and set(line["run"]["step_s"]) == {"fsdp", "expert_parallel"}
