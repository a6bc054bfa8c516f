"""The decode-step roofline of benchmarks/sampler.py: model FLOPs of a workload, the device's measured copy
bandwidth, and the tokens/s a decode step allows when it must read the weights and the live KV cache once."""
from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import best_seconds


def _contexts(prompts: list[list[int]], lengths: list[int]) -> np.ndarray:
    """The context of every generated token: P + 1 .. P + L for a request of prompt P and length L."""
    return np.concatenate([len(p) + np.arange(1, n + 1, dtype=np.float64) for p, n in zip(prompts, lengths)] or
                          [np.zeros(0)])


def state_size(cfg) -> int:
    """Elements of one row's state in one stateful layer: Gated DeltaNet's value heads x key_dim x value_dim, Mamba-2's
    heads x head_dim x state; 0 for a short convolution (its window only)."""
    if cfg.linear is not None:
        return cfg.linear.value_heads * cfg.linear.key_dim * cfg.linear.value_dim
    return 0 if cfg.mamba is None else cfg.mamba.heads * cfg.mamba.head_dim * cfg.mamba.state


def workload_flops(cfg, prompts: list[list[int]], lengths: list[int]) -> float:
    """Model FLOPs of prefilling every prompt and generating every token (real context only; a sliding layer's
    within its window; a stateful layer's state update and read, 4 x its state's size a token (`state_size`), in
    place of attention, or beside it in a hybrid layer)."""
    d, hq, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    dense = 2 * (cfg.matmul_params_per_token + d * cfg.vocab_size)  # per token, incl. the unembedding
    total = 0.0
    for p, n in zip(prompts, lengths):
        ctx = np.arange(1, len(p) + n + 1, dtype=np.float64)  # context each token attends to
        total += (len(p) + n) * dense
        for i in range(cfg.num_layers):
            if cfg.layer_is_linear(i) or cfg.layer_is_hybrid(i):  # the state's update and read (a short conv: none)
                total += (len(p) + n) * 4.0 * state_size(cfg)
            if not cfg.layer_is_linear(i):
                window = cfg.layer_window(i)
                total += 4.0 * hq * hd * (ctx if window is None else np.minimum(ctx, window)).sum()
    return total


def copy_bandwidth_gbs(nbytes: int, repeats: int = 5) -> float:
    """Best read + write GB/s of a jitted elementwise pass over an array of ``nbytes`` (float32)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / best_seconds(lambda: f(x), repeats) / 1e9


def cache_bytes_per_row(cfg, prompts: list[list[int]], lengths: list[int]) -> float:
    """Cache bytes one decode step must touch for one live row, time-averaged over the workload's generated tokens:
    each attention layer reads its keys and values over the row's context (a sliding layer's over its window at
    most; latent attention's one latent a position: `mla.cache_layout`) in the cache's dtype
    (`transformer.cache_dtype`), and each stateful layer (Gated DeltaNet, a short convolution, Mamba-2; a hybrid
    layer's beside its attention) reads and writes its state and convolution window (`mixers`' state_bytes)."""
    from areal_jax.models.mixers import kind
    from areal_jax.models.mla import cache_layout
    from areal_jax.models.transformer import cache_dtype

    ctx = _contexts(prompts, lengths)
    heads, k_dim, v_dim = cache_layout(cfg)
    per_position = heads * (k_dim + v_dim) * jnp.dtype(cache_dtype(cfg)).itemsize
    total = 0.0
    for i in range(cfg.num_layers):
        if cfg.layer_is_linear(i) or cfg.layer_is_hybrid(i):
            total += 2 * kind(cfg).state_bytes(cfg)
        if cfg.layer_is_linear(i):
            continue
        window = cfg.layer_window(i)
        read = ctx if window is None else np.minimum(ctx, window)
        total += (float(read.mean()) if read.size else 0.0) * per_position
    return total


def roofline(cfg, params, prompts, lengths, live_rows: float, bandwidth_gbs: float) -> dict:
    """Bytes one decode step must read (weights + each live row's cache: `cache_bytes_per_row`) and the tokens/s
    that allows at ``bandwidth_gbs``.

    The live context of a row is time-averaged over its generation: a sequence of prompt P and length L
    attends P + j positions at its j-th step."""
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    ctx = _contexts(prompts, lengths)
    step_bytes = weight_bytes + live_rows * cache_bytes_per_row(cfg, prompts, lengths)
    step_s = step_bytes / (bandwidth_gbs * 1e9)
    return {"weight_bytes": int(weight_bytes), "mean_live_context": round(float(ctx.mean()) if ctx.size else 0.0, 1),
            "live_rows": float(f"{live_rows:.4g}"), "bytes_per_step": int(step_bytes),
            "step_ms_at_bandwidth": round(1e3 * step_s, 4), "tokens_per_s": round(live_rows / step_s, 1)}


def live_contexts(prompts: list[list[int]], lengths: list[int], rows: int, rng: np.random.Generator) -> np.ndarray:
    """Contexts of ``rows`` rows of a never-empty queue's steady state: a row is a request drawn in proportion to
    its length L (it holds a slot for L steps), at a uniform point j of its generation (context P + j)."""
    weights = np.asarray(lengths, np.float64)
    picks = rng.choice(len(lengths), size=rows, p=weights / weights.sum())
    return np.array([len(prompts[i]) + int(rng.integers(0, lengths[i])) for i in picks], np.int64)


def bare_dispatch(engine, params, vocab: int, prompts: list[list[int]], lengths: list[int], k: int,
                  repeats: int = 8, profile: str | None = None, seed: int = 0) -> dict:
    """The k-step decode dispatch alone, without the loop: every slot live, ``repeats`` dispatches issued back to
    back after two warm-up ones (no admission, no result fetched in between), then one wait.

    The rows' contexts follow the steady state of the workload (``live_contexts``; on a dense cache the
    attention reads up to the longest row, so one context for all would undercount it), capped so that every
    step fits the cache (fewer repeats where the positions run out). Over pages every row starts at the mean of
    those contexts (each row attends to its own pages only).

    What it separates: a steady-state step slower than this one is paying for the loop (admission,
    prefill, host work between dispatches); a bare step far above the roofline is the device program's own
    cost, which ``profile`` (a directory: the timed dispatches run inside a jax.profiler trace, for
    benchmarks/trace_top.py) breaks down by kernel."""
    from areal_jax.sampler import SamplingParams
    from areal_jax.sampler.paged_engine import PagedEngine

    slots, rng = engine.num_slots, np.random.default_rng(seed)
    repeats = max(1, min(repeats, (engine.max_len - 1) // k - 2))
    cap = max(1, engine.max_len - (repeats + 2) * k - 1)  # room for every step
    contexts = np.clip(live_contexts(prompts, lengths, slots, rng), 1, cap)
    paged = isinstance(engine, PagedEngine)
    first = int(round(contexts.mean())) if paged else int(contexts.min())
    sampling = SamplingParams(temperature=1.0, max_new_tokens=engine.max_len - first)  # no slot finishes
    params = engine.place_params(params)  # held flat, as a SamplerLoop holds them
    prefix = engine.prefill(params, rng.integers(3, vocab, size=first))
    state = engine.bulk_insert(prefix, engine.init_decode_state(), range(slots), sampling)
    if not paged:  # each row at its own context (the cache's contents do not change the cost)
        state = dataclasses.replace(state, lengths=jax.device_put(contexts.astype(np.int32), state.lengths.sharding))
    else:
        contexts = np.full(slots, first)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), k)))

    def run(n: int):
        nonlocal state
        for _ in range(n):
            state, result = engine.generate_steps(params, state, keys)
        jax.block_until_ready(state)
        return result

    # Two warm-up dispatches: the first may compile for the inserted state (its replaced lengths are committed
    # to a device, which is part of jit's cache key), the second for a dispatch's own output, as every timed one.
    result = run(2).to_host()
    assert int(result.valid.sum()) == slots * k, "a slot stopped during the bare dispatch"
    compiled = engine.compile_count
    with jax.profiler.trace(profile, create_perfetto_trace=True) if profile else contextlib.nullcontext():
        t = time.perf_counter()
        result = run(repeats).to_host()
        seconds = time.perf_counter() - t
    assert int(result.valid.sum()) == slots * k, "a slot stopped during the bare dispatch"
    assert engine.compile_count == compiled, "the timed bare dispatches compiled a program"
    return {"rows": slots, "context_mean": round(float(contexts.mean()), 1), "context_max": int(contexts.max()),
            "decode_steps": k, "dispatches": repeats, "step_ms": round(1e3 * seconds / (repeats * k), 4),
            "profile": profile}
