"""Paged decode attention at latent attention's width: the pieced kernel (models.paged_pieces: pages read in place,
576 as 512 + 64) against the gather path (each row's pages copied into a contiguous view first), same device, same
dtype, same pages, queries and page tables.

One decode step's attention for --rows rows, each at the last position of --context positions spread over shuffled
pages, --heads query heads over one kv head whose keys serve as values (DeepSeek's cache). Prints the best time of
each path, the ratio (gather / kernel: > 1 means the kernel is faster), the bytes a step must read (each row's
cache once) over the time as GB/s, and that as a share of this device's measured copy bandwidth; checks that both
paths agree. Ends with one JSON line.

    python benchmarks/paged_pieces.py                                     # on a GPU: V2-Lite's 16 heads, bf16
    python benchmarks/paged_pieces.py --heads 128 --context 8192          # V3's heads
    python benchmarks/paged_pieces.py --rows 4 --context 256 --dtype float32 --interpret   # the CPU: interpreted
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import best_seconds  # noqa: E402

from areal_jax.models.paged_attention import PagedKVCache, gather_attention, kernel_attention  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--context", type=int, default=2048, help="positions per row (the step reads them all)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--width", type=int, default=576, help="cached key width (latent + rotary key)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--interpret", action="store_true", help="run the kernel in the Pallas interpreter (CPU)")
    return p.parse_args(argv)


def copy_bandwidth_gbs(nbytes: int) -> float:
    """Best read + write GB/s of a jitted elementwise pass over ``nbytes``."""
    x = jnp.ones((max(1, nbytes // 4),), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / best_seconds(lambda: f(x)) / 1e9


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    per_row = -(-args.context // args.page_size)
    n = args.rows * per_row + 8
    rng = np.random.default_rng(0)
    pages = jnp.asarray(rng.normal(size=(1, n, args.page_size, args.width)), dtype)
    cache = PagedKVCache((pages,), (pages,))  # the keys serve as values
    table = jnp.asarray(rng.permutation(n)[: args.rows * per_row].reshape(args.rows, per_row), jnp.int32)
    q = jnp.asarray(rng.normal(size=(args.rows, 1, args.heads, args.width)), dtype)
    positions = jnp.full((args.rows, 1), args.context - 1, jnp.int32)
    gather = jax.jit(lambda q, c, t, p: gather_attention(q, c, 0, t, p))
    kernel = jax.jit(lambda q, c, t, p: kernel_attention(q, c, 0, t, p, interpret=args.interpret, platform="gpu"))
    want, got = gather(q, cache, table, positions), kernel(q, cache, table, positions)
    error = float(jnp.abs(want.astype(jnp.float32) - got.astype(jnp.float32)).max())
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    if not error <= tolerance:
        raise SystemExit(f"the kernel and the gather path disagree by {error} (tolerance {tolerance})")
    repeats = 1 if args.interpret else args.repeats
    times = {name: best_seconds(lambda f=f: f(q, cache, table, positions), repeats)
             for name, f in (("gather", gather), ("kernel", kernel))}
    read = args.rows * args.context * args.width * dtype.itemsize  # each row's cache, once
    bandwidth = copy_bandwidth_gbs(min(4 << 30, max(read, 64 << 20)))
    device = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    out = {"benchmark": "paged_pieces", "device": device, "dtype": args.dtype, "rows": args.rows,
           "context": args.context, "heads": args.heads, "width": args.width, "page_size": args.page_size,
           "interpret": args.interpret, "max_abs_error": error, "copy_bandwidth_gbs": bandwidth,
           "cache_bytes_read": read}
    print(f"{args.rows} rows x {args.context} positions, {args.heads} heads over one {args.width}-wide kv head, "
          f"{args.dtype}, on {device}; copy bandwidth {bandwidth:.0f} GB/s")
    for name in ("gather", "kernel"):
        gbs = read / times[name] / 1e9
        out[f"{name}_ms"], out[f"{name}_gbs"], out[f"{name}_share"] = times[name] * 1e3, gbs, gbs / bandwidth
        print(f"  {name:>6}: {times[name] * 1e3:9.3f} ms  {gbs:8.1f} GB/s of the cache  ({gbs / bandwidth:.1%} of copy)")
    out["ratio"] = times["gather"] / times["kernel"]
    print(f"  gather / kernel = {out['ratio']:.2f}x   (max |difference| {error:.2e}; "
          f"{math.ceil(args.heads / 16)} head block(s) per page read)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
