"""Decode steps of a sliding-window model (Gemma 3's layout) when each sliding layer reads only its window, against
the same step reading the whole context under the window's mask (what the cache paths did before).

A Gemma-3-shaped decoder cut to --layers layers (every --pattern-th layer global, the others sliding with a window
of --window positions; the 1B model's heads by default: 4 query heads on 1 key/value head of 256), --rows rows each
at a random depth of a --context-position cache (rows of a long reasoning rollout at every stage), one new token
per row. Both variants run the same weights on the same cache under `jax.jit` with the cache donated, as the
sampler's engine does; the dense KV cache and the paged one (gather path) are timed. The baseline is the same code
with the window's read turned off (`cache_attention.window_span` made larger than the cache): every sliding layer
then reads positions 0..p under the mask. Checks both give the same logits, prints the median step times side by
side with their ratio, and ends with one JSON line.

A third variant keeps each sliding layer's rows as rings of its window (`init_cache(ring=True)`; for the paged
cache, rings beside pages that then hold only the global layers), what the sampler's engines allocate by default:
its step time and the cache's size are printed beside the full-length rows'.

    python benchmarks/sliding_window.py                      # about a minute on 2 CPU cores
    python benchmarks/sliding_window.py --context 16384 --rows 16
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import cache_attention, paged_attention
from areal_jax.models.paged_attention import gather_rows, init_paged_cache, init_rings, paged_hidden
from areal_jax.models.transformer import init_cache, ring_layers
from areal_jax.sampler.prefill import ring_rows
from areal_jax.testing import models as testing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--pattern", type=int, default=6, help="every this many layers one is global (Gemma 3: 6)")
    p.add_argument("--window", type=int, default=512, help="sliding window (gemma-3-1b: 512; 4B and up: 1024)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", type=int, default=8192, help="cache positions per row")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="params and compute")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@contextlib.contextmanager
def whole_context_reads():
    """Sliding layers read the whole context under the window's mask (the code before the windowed reads)."""
    saved = cache_attention.window_span, paged_attention.window_span
    cache_attention.window_span = paged_attention.window_span = lambda window: 1 << 40
    try:
        yield
    finally:
        cache_attention.window_span, paged_attention.window_span = saved


def median_seconds(fn, args, repeats: int) -> tuple[float, object]:
    """Median seconds of fn(*args) -> (logits, state), args[1] the state: a copy of its own, donated from call to
    call as the engine donates its decode state (each call rewrites the same position with the same values)."""
    args = list(args)
    args[1] = jax.tree.map(jnp.copy, args[1])
    out, args[1] = jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out, args[1] = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    types = tuple("full_attention" if (i + 1) % a.pattern == 0 else "sliding_attention" for i in range(a.layers))
    cfg = testing.tiny_config("gemma3", num_layers=a.layers, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                              num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim, vocab_size=a.vocab,
                              sliding_window=a.window, layer_types=types, query_pre_attn_scalar=float(a.head_dim),
                              max_position_embeddings=max(a.context, 32768), dtype=a.dtype, param_dtype=a.dtype)
    model = testing.random_model(cfg, seed=a.seed)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(a.seed)
    b, s = a.rows, a.context
    positions = jnp.asarray(rng.integers(a.window, s, (b, 1)), jnp.int32)  # rows at every depth, as in RL
    tokens = jnp.asarray(rng.integers(0, a.vocab, (b, 1)), jnp.int32)

    def filled(like):
        return jnp.asarray(rng.normal(size=like.shape).astype(np.float32) * 0.5, like.dtype)

    dense = init_cache(cfg, b, s)
    dense = type(dense)(k=tuple(filled(x) for x in dense.k), v=tuple(filled(x) for x in dense.v))
    pages_per_row = s // a.page_size
    paged = init_paged_cache(cfg, b * pages_per_row, a.page_size)
    paged = type(paged)(k=tuple(filled(x) for x in paged.k), v=tuple(filled(x) for x in paged.v))
    table = jnp.asarray(rng.permutation(b * pages_per_row).reshape(b, pages_per_row), jnp.int32)

    # The ring variants hold the same positions: each sliding layer's last ring-length positions before the new one.
    rings = ring_layers(cfg, s)
    as_ring = lambda x, i: ring_rows(x, positions[:, 0], x_len[i]) if i in rings else x  # noqa: E731
    x_len = [x.shape[1] for x in init_cache(cfg, 1, s, ring=True).k]
    dense_ring = type(dense)(k=tuple(as_ring(x, i) for i, x in enumerate(dense.k)),
                             v=tuple(as_ring(x, i) for i, x in enumerate(dense.v)))
    no_pages = lambda x, i: x[:, :0] if i in rings else x  # noqa: E731
    paged_ring = type(paged)(k=tuple(no_pages(x, i) for i, x in enumerate(paged.k)),
                             v=tuple(no_pages(x, i) for i, x in enumerate(paged.v)))
    ring_rows_of = init_rings(cfg, b, s, rings)
    ring_rows_of = type(ring_rows_of)(  # the paged rows' own positions, gathered through the table
        k=tuple(as_ring(gather_rows(x, table), i) if i in rings else r for i, (x, r) in
                enumerate(zip(paged.k, ring_rows_of.k))),
        v=tuple(as_ring(gather_rows(x, table), i) if i in rings else r for i, (x, r) in
                enumerate(zip(paged.v, ring_rows_of.v))))

    def dense_step(params, cache, tokens, positions, ring=False):
        return nnx.merge(graphdef, params)(tokens, positions, cache=cache, ring=ring)

    def paged_step(params, state, table, tokens, positions):
        m, (pages, rings) = nnx.merge(graphdef, params), state
        out = paged_hidden(m, tokens, positions, pages, table, path="gather", rings=rings)
        return m.unembed(out[0]), (out[1], out[2] if rings is not None else None)

    def mib(*trees):
        return sum(x.size * x.dtype.itemsize for t in trees for x in jax.tree.leaves(t)) / 2**20

    rows, results = [], {}
    for name, step, args, ring_step, ring_args, sizes in (
            ("dense", dense_step, (params, dense, tokens, positions),
             lambda *x: dense_step(*x, ring=True), (params, dense_ring, tokens, positions),
             (mib(dense), mib(dense_ring))),
            ("paged", paged_step, (params, (paged, None), table, tokens, positions),
             paged_step, (params, (paged_ring, ring_rows_of), table, tokens, positions),
             (mib(paged), mib(paged_ring, ring_rows_of)))):
        with whole_context_reads():  # a function of its own: jax.jit caches its trace per function
            base_s, base_out = median_seconds(jax.jit(lambda *x, step=step: step(*x), donate_argnums=1), args,
                                              a.repeats)
        new_s, new_out = median_seconds(jax.jit(lambda *x, step=step: step(*x), donate_argnums=1), args, a.repeats)
        ring_s, ring_out = median_seconds(jax.jit(lambda *x, step=ring_step: step(*x), donate_argnums=1), ring_args,
                                          a.repeats)
        err = float(np.abs(np.asarray(new_out) - np.asarray(base_out)).max())
        ring_err = float(np.abs(np.asarray(ring_out) - np.asarray(base_out)).max())
        bound = 1e-3 if a.dtype == "float32" else 0.1
        assert err < bound, f"{name}: the windowed read changed the logits by {err}"
        assert ring_err < bound, f"{name}: the ring cache changed the logits by {ring_err}"
        results[name] = {"whole_context_ms": base_s * 1e3, "window_ms": new_s * 1e3, "speedup": base_s / new_s,
                         "max_logit_diff": err, "ring_ms": ring_s * 1e3, "ring_vs_window": new_s / ring_s,
                         "ring_max_logit_diff": ring_err, "cache_mib": sizes[0], "ring_cache_mib": sizes[1],
                         "ring_memory_ratio": sizes[0] / sizes[1]}
        rows.append(f"{name:6s} {base_s * 1e3:12.1f} {new_s * 1e3:12.1f} {base_s / new_s:8.2f}x   {err:.1e}   "
                    f"{ring_s * 1e3:10.1f} {new_s / ring_s:7.2f}x   {sizes[0]:9.1f} {sizes[1]:9.1f} "
                    f"{sizes[0] / sizes[1]:6.2f}x")
    device = f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}, {len(jax.devices())} device(s))"
    sliding = sum(t == "sliding_attention" for t in types)
    print(f"device: {device}; {a.layers} layers ({sliding} sliding, window {a.window}), {a.heads} heads / {a.kv_heads}"
          f" kv heads x {a.head_dim}, {b} rows at positions {a.window}-{s - 1} of a {s}-position cache, {a.dtype}")
    print(f"{'cache':6s} {'whole (ms)':>12s} {'window (ms)':>12s} {'ratio':>9s}   max diff   {'ring (ms)':>10s} "
          f"{'vs win':>7s}   {'full MiB':>9s} {'ring MiB':>9s} {'ratio':>6s}")
    print("\n".join(rows))
    summary = {"benchmark": "sliding_window", "device": device, "layers": a.layers, "sliding_layers": sliding,
               "window": a.window, "rows": b, "context": s, "head_dim": a.head_dim, "dtype": a.dtype, **results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
