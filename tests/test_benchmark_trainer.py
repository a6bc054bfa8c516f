"""benchmarks/trainer.py at toy size: the presets' code path (shapes, bf16, remat, attention, same-device
HF baseline, one long trajectory) runs and the JSON line carries the figures the trainer issue asks for."""

import numpy as np
import pytest

from areal_jax.testing.processes import run_benchmark


def run(*flags):
    return run_benchmark("trainer.py", "--toy", "--repeats", "1", *flags)


def toy_params(heads, kv, layers=2, hd=16, vocab=512):
    """Parameter count of the --toy shape (hidden = heads * 16, intermediate = heads * 40, tied, q/k/v bias)."""
    d, f = heads * 16, heads * 40
    attn = d * heads * hd + 2 * d * kv * hd + heads * hd * d + heads * hd + 2 * kv * hd
    return layers * (attn + 3 * d * f + 2 * d) + vocab * d + d


@pytest.mark.long  # (excluded from the default run: `-m long`)
def test_qwen_preset_at_toy_size_bf16_with_same_device_baseline():
    report, text = run("--preset", "qwen2.5-0.5b", "--sequential")
    assert report["benchmark"] == "trainer" and report["preset"] == "qwen2.5-0.5b" and report["toy"]
    assert report["dtype"] == "bfloat16" and report["remat"] == "none" and report["attention"] == "auto"
    assert report["params"] == toy_params(14, 2)  # the preset's 14 / 2 head layout at head_dim 16
    assert report["trajectories"] == 8 and report["tokens"] > 8 * (8 + 2 - 1)
    assert report["platform"] == "cpu" and report["hf_device"] == "cpu" and report["hf_note"] is None
    for name in ("jax_loglinear", "jax_recompute", "hf_torch"):
        tps, mfu, tflops = report["tokens_per_s"][name], report["mfu"][name], report["tflops"][name]
        assert tps > 0 and mfu > 0
        # MFU is the model FLOP rate over the measured bf16 matmul peak of the run
        np.testing.assert_allclose(mfu, tflops * 1e3 / report["peak_gflops"], rtol=0.02, atol=2e-3)
    assert report["speedup_vs_hf"] > 0
    assert set(report["peak_memory_bytes"]) == {"jax_loglinear", "jax_recompute", "hf_torch"}
    assert report["process_peak_rss_bytes"] > 0
    # One device: each micro-step holds at most micro_batch_tokens positions, so at least this share is real.
    steps, budget = report["micro_steps"], report["micro_batch_tokens"]
    assert steps >= 1 and report["tokens"] / (steps * budget) <= report["packed_fraction"] <= 1
    assert report["compile_in_micro_steps"] >= 0 and "one compile ~" in text
    assert "(bfloat16, jitted" in text and "HF transformers + PyTorch (cpu)" in text


@pytest.mark.slow
def test_one_long_trajectory_with_remat_and_flash_attention():
    report, _ = run("--preset", "qwen2.5-1.5b", "--trajectory-len", "200", "--micro-batch-tokens", "256",
                    "--remat", "full", "--attention", "flash", "--skip-hf", "--skip-recompute", "--dtype", "float32")
    assert report["trajectories"] == 1 and report["tokens"] == 199  # L - 1 packed tokens
    assert report["params"] == toy_params(12, 2)
    assert report["remat"] == "full" and report["attention"] == "flash" and report["dtype"] == "float32"
    assert report["tokens_per_s"]["jax_loglinear"] > 0
    assert report["tokens_per_s"]["jax_recompute"] is None and report["tokens_per_s"]["hf_torch"] is None
    assert report["speedup_vs_hf"] is None


@pytest.mark.long  # (excluded from the default run: `-m long`; 33-37 s. Gemma 3's layout and its HF step are checked
# by tests/test_hf_parity_families.py, the benchmark's own path by the test above)
def test_gemma_preset_at_toy_size_against_the_same_device_baseline():
    """Gemma 3's layout (a sliding layer and a global one at toy size) through the update and the HF + PyTorch
    step built from the same shape (Gemma3ForCausalLM)."""
    report, text = run("--preset", "gemma3-1b", "--sequential", "--skip-recompute", "--dtype", "float32")
    assert report["preset"] == "gemma3-1b" and report["toy"] and report["hf_note"] is None
    d, f, hd = 4 * 16, 4 * 40, 16  # gemma3-1b's 4 query heads / 1 kv head, head_dim 16 at toy size
    layer = d * 4 * hd * 2 + d * hd * 2 + 2 * hd + 3 * d * f + 4 * d
    assert report["params"] == 2 * layer + 512 * d + d
    assert report["tokens_per_s"]["jax_loglinear"] > 0 and report["tokens_per_s"]["hf_torch"] > 0
    assert "HF transformers + PyTorch (cpu)" in text


@pytest.mark.long  # (excluded from the default run: `-m long`)
def test_phi_preset_at_toy_size_against_the_same_device_baseline():
    """Phi-4-mini's layout at toy size (24 / 8 heads of 16, 12 rotating dimensions, LongRoPE) through the update and
    the HF + PyTorch step built from the same shape (Phi3ForCausalLM, fused q/k/v)."""
    report, text = run("--preset", "phi4-mini", "--sequential", "--skip-recompute", "--dtype", "float32")
    assert report["preset"] == "phi4-mini" and report["toy"] and report["hf_note"] is None
    d, f, hd = 24 * 16, 24 * 40, 16
    layer = d * 24 * hd * 2 + d * 8 * hd * 2 + 3 * d * f + 2 * d
    assert report["params"] == 2 * layer + 512 * d + d
    assert report["tokens_per_s"]["jax_loglinear"] > 0 and report["tokens_per_s"]["hf_torch"] > 0
    assert "HF transformers + PyTorch (cpu)" in text


@pytest.mark.long  # (excluded from the default run: `-m long`; 33-38 s. Granite 3 MoE's layout and its HF step are
# checked by tests/test_granite.py, active-expert counts by tests/test_deepseek.py and tests/test_glm.py)
def test_mixture_of_experts_preset_at_toy_size_against_the_same_device_baseline():
    """Granite 3 MoE's layout at toy size (16 / 8 heads of 16, 2 of 4 experts, Granite's scalars) through the update
    and the HF + PyTorch step built from the same shape (GraniteMoeForCausalLM); model FLOPs count the active
    experts only."""
    report, text = run("--preset", "granite3-moe-1b", "--sequential", "--skip-recompute", "--dtype", "float32")
    assert report["preset"] == "granite3-moe-1b" and report["toy"] and report["hf_note"] is None
    d, f, hd = 16 * 16, 16 * 40, 16
    attn = d * 16 * hd * 2 + d * 8 * hd * 2
    assert report["params"] == 2 * (attn + 4 * 3 * d * f + 4 * d + 2 * d) + 512 * d + d
    assert report["tokens_per_s"]["jax_loglinear"] > 0 and report["tokens_per_s"]["hf_torch"] > 0
    assert "HF transformers + PyTorch (cpu)" in text
