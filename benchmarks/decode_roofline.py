"""The decode-step roofline of benchmarks/sampler.py: model FLOPs of a workload, the device's measured copy
bandwidth, and the tokens/s a decode step allows when it must read the weights and the live KV cache once."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from common import best_seconds


def workload_flops(cfg, prompts: list[list[int]], lengths: list[int]) -> float:
    """Model FLOPs of prefilling every prompt and generating every token (real context only)."""
    d, hq, hd, layers = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_layers
    per_layer = d * hd * (hq + 2 * cfg.num_kv_heads) + hq * hd * d + 3 * d * cfg.intermediate_size
    dense = 2 * (layers * per_layer + d * cfg.vocab_size)  # per token, incl. the unembedding
    total = 0.0
    for p, n in zip(prompts, lengths):
        ctx = np.arange(1, len(p) + n + 1, dtype=np.float64)  # context each token attends to
        total += (len(p) + n) * dense + 4.0 * layers * hq * hd * ctx.sum()
    return total


def copy_bandwidth_gbs(nbytes: int, repeats: int = 5) -> float:
    """Best read + write GB/s of a jitted elementwise pass over an array of ``nbytes`` (float32)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / best_seconds(lambda: f(x), repeats) / 1e9


def roofline(cfg, params, prompts, lengths, live_rows: float, bandwidth_gbs: float) -> dict:
    """Bytes one decode step must read (weights + live KV) and the tokens/s that allows at ``bandwidth_gbs``.

    The live context of a row is time-averaged over its generation: a sequence of prompt P and length L
    attends P + j positions at its j-th step."""
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    ctx = sum(n * len(p) + n * (n + 1) / 2 for p, n in zip(prompts, lengths)) / max(1, sum(lengths))
    step_bytes = weight_bytes + live_rows * ctx * kv_per_token
    step_s = step_bytes / (bandwidth_gbs * 1e9)
    return {"weight_bytes": int(weight_bytes), "mean_live_context": round(ctx, 1), "live_rows": float(f"{live_rows:.4g}"),
            "bytes_per_step": int(step_bytes), "step_ms_at_bandwidth": round(1e3 * step_s, 4),
            "tokens_per_s": round(live_rows / step_s, 1)}
