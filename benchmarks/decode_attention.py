"""Decode-step time of the model against the KV-cache length: the previous cache path against the current one.

Both run the same weights on the same cache under `jax.jit` over the split state with the cache donated (as the
sampler's engine does): one new token for each of --rows rows, every row at the last position of a cache
filled with random keys and values, so attention reads the whole cache. The previous path is kept below as
`baseline_forward`: it wrote the layer's keys / values, then ran a grouped einsum over the full [B, S] cache
slice, which XLA lowers to a transposed copy of that slice for keys and for values in every layer.
Also timed: a prefill of --prefill-rows prompts of the largest cache length into a fresh cache (the engine's
other cache call), so a decode gain is not bought with a prefill loss.

Prints per cache length the median and best step time of both paths, the ratio, tokens/s and the fraction of
this machine's float32 matmul peak, checks that both paths give the same logits, and ends with one JSON line.

    python benchmarks/decode_attention.py                       # a few minutes on 2 CPU cores
    python benchmarks/decode_attention.py --cache-lens 256 1024 --layers 8
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from common import add_model_args, matmul_peak_gflops, model_config
from flax import nnx

from areal_jax.models import KVCache, ModelConfig, Transformer, init_cache, paged_attention
from areal_jax.models.layers import MASK_VALUE
from areal_jax.models.paged_attention import PagedKVCache, paged_hidden
from areal_jax.models.paged_pieces import power_of_two_divisor
from areal_jax.models.rope import rope_cos_sin, rope_inv_freq
from areal_jax.sampler import paged_choice
from areal_jax.testing import models as testing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rows", type=int, default=64, help="decode rows (sampler slots)")
    p.add_argument("--cache-lens", type=int, nargs="+", default=(32, 128, 256))
    p.add_argument("--prefill-rows", type=int, default=8, help="0 skips the prefill check")
    p.add_argument("--repeats", type=int, default=30, help="timed calls of each path per setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paged", action="store_true",
                   help="also time the paged cache (gather path; on GPUs the Pallas kernel too, tiled as now and "
                        "as before: kernel_divisor) at each length")
    p.add_argument("--page-size", type=int, default=16)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------- the previous path
def baseline_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """The previous attention. q: [B, T, H, Dh]; k, v: [B, S, K, Dh]; mask: [B, T, S] -> [B, T, H, Dh]."""
    b, t, h, dh = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * np.float32(1.0 / math.sqrt(dh))
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, dh).astype(q.dtype)


def baseline_forward(model: Transformer, tokens: jax.Array, positions: jax.Array,
                     cache: KVCache) -> tuple[jax.Array, KVCache]:
    """The previous cache path of `Transformer.__call__`: tokens, positions [B, T] int32 -> (logits [B, T, V]
    float32, new cache). Each layer scatters its keys / values, then attends its whole [B, S] cache with one
    masked softmax."""
    cfg = model.cfg
    b, _ = tokens.shape
    s = cache.max_len
    mask = jnp.arange(s)[None, None, :] <= positions[:, :, None]
    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg))
    x = jnp.take(model.embedding[...], tokens, axis=0).astype(cfg.dtype)
    rows = jnp.arange(b)[:, None]
    write_at = jnp.where((positions >= 0) & (positions < s), positions, s)
    ks, vs = [], []
    for layer, k_layer, v_layer in zip(model.layers, cache.k, cache.v):
        q, k, v = layer.attn.qkv(layer.input_norm(x), cos, sin)
        ks.append(k_layer.at[rows, write_at].set(k.astype(k_layer.dtype), mode="drop"))
        vs.append(v_layer.at[rows, write_at].set(v.astype(v_layer.dtype), mode="drop"))
        attn = baseline_attention(q, ks[-1].astype(cfg.dtype), vs[-1].astype(cfg.dtype), mask)
        x = x + layer.attn.out(attn)
        x = x + layer.mlp(layer.post_attn_norm(x))
    return model.unembed(model.final_norm(x)), KVCache(k=tuple(ks), v=tuple(vs))


def paged_cache_of(cache: KVCache, page_size: int, seed: int) -> tuple[PagedKVCache, jax.Array]:
    """The same keys / values in shuffled pages: (PagedKVCache of L layers [K, B * S / ps, ps, Dh], page table
    [B, S / ps])."""
    b, s, kv, dh = cache.k[0].shape
    per_row = s // page_size
    order = np.random.default_rng(seed).permutation(b * per_row)
    inverse = np.argsort(order)

    def to_pages(x: jax.Array) -> jax.Array:
        pages = x.reshape(b * per_row, page_size, kv, dh).transpose(2, 0, 1, 3)
        return pages[:, inverse]  # page order[i] holds row-page i

    return (PagedKVCache(tuple(map(to_pages, cache.k)), tuple(map(to_pages, cache.v))),
            jnp.asarray(order.reshape(b, per_row), jnp.int32))


def divisor_tiling(rows: int, kv_heads: int, per_row: int, page_size: int) -> tuple[int, int, int]:
    """The GPU kernel's tiling before `paged_attention.gpu_tiling`: only power-of-two divisors of the table's width
    (up to 16 splits, then up to 8 pages a block), so 72 pages a row gave 8 splits of one-page blocks."""
    splits = power_of_two_divisor(per_row, 16)
    return per_row, splits, power_of_two_divisor(per_row // splits, 8)


def paged_forward(path: str) -> Callable:
    """path: "gather", "kernel", or "kernel_divisor" (the kernel tiled by `divisor_tiling`, traced so)."""
    def forward(model: Transformer, tokens: jax.Array, positions: jax.Array, cache: tuple) -> tuple:
        pages, table = cache
        kernel_path = "kernel" if path.startswith("kernel") else path
        tiling = paged_attention.gpu_tiling
        if path == "kernel_divisor":  # active while this function is traced, which is when the tiling is chosen
            paged_attention.gpu_tiling = divisor_tiling
        try:
            h, pages = paged_hidden(model, tokens, positions, pages, table, path=kernel_path)
        finally:
            paged_attention.gpu_tiling = tiling
        return model.unembed(h), (pages, table)

    return forward


def current_forward(model: Transformer, tokens: jax.Array, positions: jax.Array,
                    cache: KVCache) -> tuple[jax.Array, KVCache]:
    """The library's cache path, same signature as `baseline_forward`."""
    return model(tokens, positions, cache=cache)


# ----------------------------------------------------------------------------------------------- measuring

def step_flops(cfg: ModelConfig, rows: int, new_tokens: int, context: int) -> float:
    """Model FLOPs of `new_tokens` tokens in each of `rows` rows attending `context` cache positions."""
    d, hd = cfg.hidden_size, cfg.head_dim
    per_layer = d * hd * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * hd * d + 3 * d * cfg.intermediate_size
    dense = 2 * (cfg.num_layers * per_layer + d * cfg.vocab_size)
    attention = 4 * cfg.num_layers * cfg.num_heads * hd * context
    return rows * new_tokens * (dense + attention)


def random_cache(cfg: ModelConfig, rows: int, max_len: int, seed: int) -> KVCache:
    """A cache of O(1) random keys and values (L layers of [rows, max_len, K, Dh]) in the compute dtype."""
    shape = (rows, max_len, cfg.num_kv_heads, cfg.head_dim)
    keys = jax.random.split(jax.random.key(seed), 2 * cfg.num_layers)
    layers = [jax.random.normal(key, shape, jnp.float32).astype(cfg.dtype) for key in keys]
    return KVCache(k=tuple(layers[: cfg.num_layers]), v=tuple(layers[cfg.num_layers:]))


def time_pair(fns: dict[str, Callable], make_cache: Callable[[], KVCache], tokens: jax.Array, positions: jax.Array,
              repeats: int, fresh_cache: bool,
              adapt: dict[str, Callable] | None = None) -> tuple[dict[str, list[float]], dict[str, np.ndarray]]:
    """Interleaved timing (seconds per call) of jitted fn(tokens, positions, cache) -> (logits, cache), so
    that load from other processes hits both alike. The returned cache is fed back unless fresh_cache.
    adapt: per name, turns make_cache()'s dense cache into the layout that fn takes (the paged cache)."""
    adapt = adapt or {}
    makers = {name: (lambda n=name: adapt.get(n, lambda c: c)(make_cache())) for name in fns}
    caches = {name: makers[name]() for name in fns}
    logits = {}
    for name, fn in fns.items():  # compile + warm up
        out, new_cache = fn(tokens, positions, caches[name])
        logits[name] = np.asarray(out, np.float32)
        caches[name] = makers[name]() if fresh_cache else new_cache
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            cache = caches[name]
            jax.block_until_ready(cache)
            start = time.perf_counter()
            out, new_cache = fn(tokens, positions, cache)
            out.block_until_ready()
            times[name].append(time.perf_counter() - start)
            caches[name] = makers[name]() if fresh_cache else new_cache
    return times, logits


def check_agreement(err: float, reference: np.ndarray, rel_tol: float, what: str) -> None:
    """Stops the run when the paths' largest logit difference exceeds rel_tol times the largest |logit|."""
    scale = max(1.0, float(np.max(np.abs(reference))))
    if err > rel_tol * scale:
        raise SystemExit(f"{what}: the two paths' logits differ by {err:.2e}, more than {rel_tol:g} x {scale:.1f}.")


def main() -> None:
    args = parse_args()
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    cfg = model_config(args, max_position_embeddings=max(4096, max(args.cache_lens)), dtype=dtype, param_dtype=dtype)
    model = testing.random_model(cfg, seed=args.seed)
    graphdef, params = nnx.split(model)

    def jitted(forward: Callable) -> Callable:
        step = jax.jit(lambda st, tok, pos, cache: forward(nnx.merge(graphdef, st), tok, pos, cache),
                       donate_argnums=(3,))
        return lambda tok, pos, cache: step(params, tok, pos, cache)

    fns = {"baseline": jitted(baseline_forward), "current": jitted(current_forward)}
    peak = matmul_peak_gflops()
    # Largest logit difference allowed, relative to the largest logit: float32 on CPU is exact up to summation
    # order; bfloat16, or float32 matmuls on GPU (TF32 by default), round inputs to 8-10 mantissa bits.
    rel_tol = 1e-5 if dtype == jnp.float32 and jax.default_backend() == "cpu" else 2e-2
    print(f"device {jax.devices()[0].device_kind}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads, {args.dtype}, {args.rows} rows; "
          f"float32 matmul peak {peak:.0f} GFLOP/s")
    rng = np.random.default_rng(args.seed)
    results, paged_rows, paged_auto = [], [], []
    for max_len in args.cache_lens:
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.rows, 1)), jnp.int32)
        positions = jnp.full((args.rows, 1), max_len - 1, jnp.int32)
        times, logits = time_pair(fns, lambda: random_cache(cfg, args.rows, max_len, args.seed), tokens, positions,
                                  args.repeats, fresh_cache=False)
        err = float(np.max(np.abs(logits["baseline"] - logits["current"])))
        check_agreement(err, logits["baseline"], rel_tol, f"cache length {max_len}")
        if args.paged and max_len % args.page_size == 0:
            paths = ["gather"] + (["kernel", "kernel_divisor"] if jax.default_backend() == "gpu" else [])
            paged_fns = {f"paged_{p}": jitted(paged_forward(p)) for p in paths}
            paged_fns["current"] = fns["current"]
            ptimes, plogits = time_pair(
                paged_fns, lambda: random_cache(cfg, args.rows, max_len, args.seed), tokens, positions, args.repeats, fresh_cache=False, adapt={
                    name: (lambda c: paged_cache_of(c, args.page_size, args.seed)) for name in paged_fns
                    if name != "current"})
            for p in paths:
                perr = float(np.max(np.abs(plogits[f"paged_{p}"] - plogits["current"])))
                check_agreement(perr, plogits["current"], rel_tol, f"paged {p}, cache length {max_len}")
                pmed = float(np.median(ptimes[f"paged_{p}"])) * 1e3
                cmed = float(np.median(ptimes["current"])) * 1e3
                paged_rows.append({"cache_len": max_len, "path": p, "paged_ms": round(pmed, 3),
                                   "dense_ms": round(cmed, 3), "dense_over_paged": round(cmed / pmed, 3),
                                   "max_abs_logit_diff": perr})
                print(f"cache {max_len:5d}: paged ({p}, pages of {args.page_size}) {pmed:7.2f} ms | dense cache "
                      f"{cmed:7.2f} ms | dense/paged x{cmed / pmed:.2f} | logits differ by {perr:.1e}")
            auto = paged_choice.choose(cfg, args.rows, max_len // args.page_size, args.page_size)
            paged_auto.append({"cache_len": max_len, **auto.as_dict()})
            print(f"cache {max_len:5d}: paged_attention=auto takes {auto.describe()}")
        med = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        best = {name: float(np.min(t)) * 1e3 for name, t in times.items()}
        flops = step_flops(cfg, args.rows, 1, max_len)
        row = {"cache_len": max_len, "baseline_ms": round(med["baseline"], 3), "current_ms": round(med["current"], 3),
               "baseline_best_ms": round(best["baseline"], 3), "current_best_ms": round(best["current"], 3),
               "speedup": round(med["baseline"] / med["current"], 3),
               "current_tokens_per_s": round(args.rows / med["current"] * 1e3, 1),
               "current_peak_fraction": round(flops / (med["current"] * 1e-3) / (peak * 1e9), 4),
               "max_abs_logit_diff": err}
        results.append(row)
        print(f"cache {max_len:5d}: baseline {med['baseline']:7.2f} ms (best {best['baseline']:6.2f}) | current "
              f"{med['current']:7.2f} ms (best {best['current']:6.2f}) | x{row['speedup']:.2f} | "
              f"{row['current_tokens_per_s']:.0f} tok/s, {100 * row['current_peak_fraction']:.1f}% of peak | "
              f"logits differ by {err:.1e}")

    prefill = None
    if args.prefill_rows > 0:
        p = max(args.cache_lens)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.prefill_rows, p)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (args.prefill_rows, p))
        zero = lambda: init_cache(cfg, args.prefill_rows, p, dtype)  # noqa: E731
        times, logits = time_pair(fns, zero, tokens, positions, max(3, args.repeats // 3), fresh_cache=True)
        err = float(np.max(np.abs(logits["baseline"] - logits["current"])))
        check_agreement(err, logits["baseline"], rel_tol, "prefill")
        med = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        prefill = {"rows": args.prefill_rows, "length": p, "baseline_ms": round(med["baseline"], 3),
                   "current_ms": round(med["current"], 3), "speedup": round(med["baseline"] / med["current"], 3),
                   "max_abs_logit_diff": err}
        print(f"prefill {args.prefill_rows} x {p} into a fresh cache: baseline {med['baseline']:.2f} ms | current "
              f"{med['current']:.2f} ms | x{prefill['speedup']:.2f} | logits differ by {err:.1e}")

    print(json.dumps({"benchmark": "decode_attention", "device": jax.devices()[0].device_kind, "dtype": args.dtype,
                      "rows": args.rows, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
                      "matmul_peak_gflops": round(peak, 1), "decode": results, "prefill": prefill,
                      "paged": paged_rows or None, "paged_auto": paged_auto or None}))


if __name__ == "__main__":
    main()
