"""benchmarks/sampler.py at toy size: every engine runs, the JSON line carries the figures the issue asks for."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.long  # 23-37 s; the sampler loop's own tests keep a queue full, the others here run the benchmark's path
def test_sampler_benchmark_reports_steady_state_and_roofline():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "sampler.py"), "--hidden", "32", "--layers", "1",
           "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--vocab", "128", "--num-slots", "4",
           "--num-prompts", "10", "--max-new-tokens", "12", "--median-new-tokens", "4", "--prompt-len", "2", "6",
           "--decode-steps", "3", "--steady", "--warmup-seconds", "0.5", "--steady-seconds", "2", "--skip-hf"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["preset"] == "tiny" and out["dtype"] == "float32" and out["decode_steps"] == 3
    assert out["standby_rows"] == 2  # the job's default: num_slots / 2 with the dense cache and k > 1
    # decode_attention=auto, the default: XLA's attention on the CPU, untimed, with its reason in the JSON
    assert out["decode_attention"] == "xla" and out["decode_choice"]["path"] == "xla"
    assert "cpu" in out["decode_choice"]["reason"] and out["decode_choice"]["us"] == {}
    assert out["tokens_per_s"]["continuous"] > 0 and out["tokens_per_s"]["static"] > 0
    assert out["tokens_per_s"]["hf"] is None and out["ratio_a_b"] > 0
    steady = out["steady"]
    for key in ("tokens_per_s", "mean_slot_occupancy", "step_ms", "update_latency_ms", "update_latency_max_ms",
                "idle_slot_steps_per_finished"):
        assert steady[key] is not None and steady[key] >= 0, key
    assert 0 < steady["mean_slot_occupancy"] <= 1 and steady["updates"] >= 1
    bare = steady["bare"]  # the same dispatch alone: every slot live, every step inside the 18-position cache
    assert bare["rows"] == 4 and bare["decode_steps"] == 3 and bare["step_ms"] > 0 and bare["roofline_ms"] > 0
    assert abs(bare["steady_over_bare"] - steady["step_ms"] / bare["step_ms"]) < 1e-2
    assert 1 <= bare["context_mean"] <= bare["context_max"] and bare["context_max"] + (bare["dispatches"] + 2) * 3 <= 6 + 12
    roof = out["roofline"]
    # weights: the params' bytes; one step reads them plus the live KV, so bytes_per_step exceeds them.
    assert roof["bytes_per_step"] > roof["weight_bytes"] > 0
    assert roof["weight_bytes"] == 4 * out["params"]  # float32 params
    want = roof["live_rows"] * out["copy_bandwidth_gbs"] * 1e9 / roof["bytes_per_step"]
    assert abs(roof["tokens_per_s"] - want) <= 0.01 * want + 1  # rows / (bytes per step / bandwidth)
    assert 0 < roof["share"] and out["copy_bandwidth_gbs"] > 0


def test_live_contexts_follow_the_steady_state_worked_by_hand(monkeypatch):
    # A request of prompt P and length L holds a slot for L steps at contexts P, P + 1, ..., P + L - 1. With a
    # 5-token prompt generating 1 token and a 3-token prompt generating 3, a live row is the first a quarter of
    # the time (context 5) and the second three quarters (3, 4 or 5 alike): P(3) = P(4) = 1/4, P(5) = 1/2.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import numpy as np
    from decode_roofline import live_contexts

    got = live_contexts([[7] * 5, [7] * 3], [1, 3], 40_000, np.random.default_rng(0))
    share = {c: float(np.mean(got == c)) for c in (3, 4, 5)}
    assert set(np.unique(got)) == {3, 4, 5}
    assert abs(share[3] - 0.25) < 0.01 and abs(share[4] - 0.25) < 0.01 and abs(share[5] - 0.5) < 0.01


def test_roofline_cache_bytes_follow_each_kind_of_layer_worked_by_hand(monkeypatch):
    # Requests of prompt 5 generating 1 token and prompt 3 generating 3: contexts 6 and 4, 5, 6 (mean 5.25).
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from decode_roofline import cache_bytes_per_row, workload_flops

    from areal_jax.testing.models import tiny_config

    prompts, lengths = [[7] * 5, [7] * 3], [1, 3]
    per_position = 2 * (16 + 16) * 4  # 2 kv heads of 16 keys and 16 values, float32 on the CPU
    assert cache_bytes_per_row(tiny_config("qwen2"), prompts, lengths) == 2 * 5.25 * per_position
    # Gemma 3's first layer slides over 4 positions (contexts 6, 4, 5, 6 read 4 each), its second attends to all
    gemma = tiny_config("gemma3", sliding_window=4)
    assert cache_bytes_per_row(gemma, prompts, lengths) == (4 + 5.25) * per_position
    # Qwen3.5: three Gated DeltaNet layers read and write a state of 4 value heads x 8 x 12 and a window of 3 taps
    # over 2 x 2 x 8 + 4 x 12 = 80 channels, float32; the attention layer reads its cache
    hybrid = tiny_config("qwen3_5_text", num_layers=4)
    state = 4 * (3 * 80 + 4 * 8 * 12)
    assert cache_bytes_per_row(hybrid, prompts, lengths) == 3 * 2 * state + 5.25 * per_position
    # Bamba: three Mamba-2 layers (4 heads of 32, 2 groups of 16: 128 + 64 channels in a window of 3 taps, a state of
    # 128 x 16) and one of attention; Falcon-H1: both in each of its two layers (4 heads of 24: 96 + 64 channels)
    mamba = 4 * (3 * 192 + 128 * 16)
    assert cache_bytes_per_row(tiny_config("bamba", num_layers=4), prompts, lengths) == \
        3 * 2 * mamba + 5.25 * per_position
    assert cache_bytes_per_row(tiny_config("falcon_h1"), prompts, lengths) == \
        2 * (2 * 4 * (3 * 160 + 96 * 16) + 5.25 * per_position)
    dense = 2 * (hybrid.matmul_params_per_token + 64 * 97)
    tokens, contexts = 5 + 1 + 3 + 3, sum(range(1, 7)) + sum(range(1, 7))
    want = tokens * dense + 3 * tokens * 4 * 4 * 8 * 12 + 4 * 4 * 16 * contexts
    assert abs(workload_flops(hybrid, prompts, lengths) - want) < 1e-6 * want
    falcon = tiny_config("falcon_h1")  # each layer: attention over the context and a 4 x 24 x 16 state
    want = tokens * 2 * (falcon.matmul_params_per_token + 64 * 97) + 2 * (tokens * 4 * 4 * 24 * 16 + 4 * 4 * 16 * contexts)
    assert abs(workload_flops(falcon, prompts, lengths) - want) < 1e-6 * want


@pytest.mark.long  # 30-40 s; the sampler benchmark's other tests run its path, tests/test_qwen3_5.py the hybrid sampler
def test_hybrid_preset_at_toy_size_runs_and_counts_its_states():
    """The Qwen3.5-9B preset's layer kinds at toy size (three Gated DeltaNet layers and one of attention): the
    sampler runs it, and the roofline's cache bytes are its one attention layer's KV plus the states."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "sampler.py"), "--preset", "qwen3.5-9b", "--toy",
           "--dtype", "float32", "--num-slots", "4", "--num-prompts", "6", "--max-new-tokens", "10",
           "--median-new-tokens", "4", "--prompt-len", "2", "6", "--decode-steps", "3", "--skip-static", "--skip-hf"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["preset"] == "qwen3.5-9b" and out["generated_tokens"] > 0 and out["tokens_per_s"]["continuous"] > 0
    roof = out["roofline"]
    state = 4 * (3 * (2 * 4 * 16 + 8 * 16) + 8 * 16 * 16)  # 4 key / 8 value heads of 16, 4 taps, float32
    kv = roof["mean_live_context"] * 4 * (16 + 16) * 4  # the attention layer: 4 kv heads (the 9B's) of 16
    want = roof["weight_bytes"] + roof["live_rows"] * (3 * 2 * state + kv)
    assert abs(roof["bytes_per_step"] - want) <= 1e-3 * want


def test_new_shapes_are_the_checkpoints_defaults():
    from areal_jax.models.config import ModelConfig
    from areal_jax.system.loadgen import shape_config

    for name, model_type in (("qwen3.5-9b", "qwen3_5_text"), ("ministral3-8b", "ministral3")):
        got, hf = shape_config(name, max_len=2048), ModelConfig.from_hf_dict({"model_type": model_type})
        assert got.num_params == hf.num_params and got.layer_types == hf.layer_types and got.linear == hf.linear
        assert got.rope_scaling == hf.rope_scaling and got.eos_token_id is None
    nano = shape_config("nemotron-nano-9b-v2", max_len=2048)  # transformers' count (tests/test_nemotron_h.py)
    assert nano.num_params == 8_888_227_328 and nano.mamba.groups == 8 and sum(nano.mlp_layers) == 25
    toy = shape_config("nemotron-nano-9b-v2", max_len=64, num_layers=3)
    assert toy.layer_types == ("linear_attention",) * 3 and toy.mlp_layers == (1, 1, 1)
    falcon = shape_config("falcon-h1-0.5b", max_len=2048)  # transformers' count (tests/test_falcon_h1.py)
    assert falcon.num_params == 521_411_104 and falcon.layer_types == ("hybrid",) * 36
    assert shape_config("falcon-h1-0.5b", max_len=64, num_layers=2).layer_types == ("hybrid",) * 2
