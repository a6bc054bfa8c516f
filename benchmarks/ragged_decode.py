"""Decode attention over the dense KV cache: XLA's path against the ragged kernel (models/ragged_decode.py).

Both run on the same device, in the same dtype, over the same caches: --layers layers of [--rows, --max-len] positions,
one new query per row, each row at a context drawn as in the sampler benchmark's steady state (prompts of
--prompt-len tokens, generation lengths log-normal with median --median and log-std --sigma, capped at --cap; a live
row sits at any generated token's context with equal chance, so long generations weigh more). XLA's path is the
engine's default (`cache_attention.cached_attention`: on GPUs one pass over every position of the cache); the kernel
reads each row up to its own context.

Prints each path's best time for one decode step's attention over all layers, the bytes of keys and values it must
read (the rows' live contexts) over the device's measured copy bandwidth (the roofline) and the share of it reached,
the ratio XLA / kernel, the largest difference between the paths' outputs, what the sampler's decode_attention="auto"
takes at this shape (sampler/decode_choice.py: its own timing of one layer, rows spread evenly over the cache), and
ends with one JSON line. --tilings times the kernel at other (splits, block) tilings too.

    python benchmarks/ragged_decode.py                                   # a GPU: Qwen2.5-0.5B's sampler shape
    python benchmarks/ragged_decode.py --rows 64 --max-len 16512 --heads 12 --kv-heads 2 --head-dim 128 \\
        --median 16384 --sigma 0 --cap 16384 --layers 28                  # the 1.5B shape at 16k positions
    python benchmarks/ragged_decode.py --interpret --rows 8 --max-len 96 --layers 2 --median 32 --cap 64 \\
        --prompt-len 8 16                                                 # off GPUs: the interpreter, no speed figure
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from common import best_seconds
from decode_roofline import copy_bandwidth_gbs

from areal_jax.models.cache_attention import cached_attention
from areal_jax.models.ragged_decode import decode_attention, default_tiling, ragged_decode_attention, supports
from areal_jax.sampler.decode_choice import choose_shape


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256, help="decode rows (sampler slots)")
    p.add_argument("--max-len", type=int, default=1152, help="positions per row of the cache")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--median", type=int, default=256, help="median generation length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-std of the generation lengths")
    p.add_argument("--cap", type=int, default=1024, help="longest generation")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tilings", nargs="*", default=(), metavar="SPLITSxBLOCK",
                   help="also time the kernel at these tilings (e.g. 2x128 4x64), beside its default one")
    p.add_argument("--interpret", action="store_true",
                   help="run the kernel in the Pallas interpreter (off GPUs: a correctness check, no speed figure)")
    args = p.parse_args(argv)
    if args.prompt_len[1] + args.cap > args.max_len:
        p.error(f"--max-len {args.max_len} cannot hold a prompt of {args.prompt_len[1]} and {args.cap} new tokens.")
    try:
        args.tilings = [tuple(int(x) for x in s.lower().split("x")) for s in args.tilings]
    except ValueError:
        p.error(f"--tilings takes SPLITSxBLOCK entries such as 2x128, got {args.tilings}.")
    if any(len(x) != 2 or x[0] < 1 or x[1] < 16 or x[1] & (x[1] - 1) or x[1] > args.max_len for x in args.tilings):
        p.error(f"--tilings: splits >= 1 and blocks powers of two in [16, --max-len], got {args.tilings}.")
    if not supports(args.head_dim, args.head_dim, args.max_len) or args.heads % args.kv_heads:
        p.error("the kernel takes a power-of-two --head-dim of at least 16, --max-len >= 16 and --heads a multiple "
                "of --kv-heads.")
    return args


def steady_contexts(args: argparse.Namespace, rng: np.random.Generator) -> np.ndarray:
    """[rows] positions of live rows in the steady state: a generated token's context, every generated token of
    4,096 requests equally likely (a long generation holds its slot for more steps)."""
    prompts = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, size=4096)
    lengths = np.clip(np.ceil(np.exp(rng.normal(np.log(args.median), args.sigma, size=4096))), 2, args.cap)
    contexts = np.concatenate([p + np.arange(1, int(n) + 1) for p, n in zip(prompts, lengths)])
    return rng.choice(contexts, size=args.rows).astype(np.int32) - 1  # the position of the query


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    backend = jax.default_backend()
    if backend != "gpu" and not args.interpret:
        sys.exit(f"the kernel is a Triton (GPU) kernel and this backend is {backend}: pass --interpret with small "
                 "shapes for a correctness check (no speed figure).")
    rng = np.random.default_rng(args.seed)
    dtype = jnp.dtype(args.dtype)
    positions = jnp.asarray(steady_contexts(args, rng))[:, None]
    keys = jax.random.split(jax.random.key(args.seed), 3)
    shape = (args.layers, args.rows, args.max_len, args.kv_heads, args.head_dim)
    q = jax.random.normal(keys[0], (args.layers, args.rows, 1, args.heads, args.head_dim), dtype)
    k = jax.random.normal(keys[1], shape, dtype)
    v = jax.random.normal(keys[2], shape, dtype)

    def every_layer(attend):  # one decode step's attention, layer after layer (each reads its own cache)
        return jax.jit(lambda q, k, v, p: jnp.stack([attend(q[i], k[i], v[i], p) for i in range(args.layers)]))

    paths = {"xla": every_layer(lambda q, k, v, p: cached_attention(q, k, v, p)),
             "kernel": every_layer(lambda q, k, v, p: decode_attention(q, k, v, p, interpret=args.interpret))}
    for splits, block in args.tilings:  # the same kernel, tiled otherwise
        paths[f"{splits}x{block}"] = every_layer(
            lambda q, k, v, p, s=splits, b=block: ragged_decode_attention(
                q[:, 0], k, v, jnp.clip(p[:, 0] + 1, 0, args.max_len), splits=s, block=b,
                interpret=args.interpret)[:, None])
    outs = {name: fn(q, k, v, positions) for name, fn in paths.items()}
    diff = max(float(jnp.max(jnp.abs(outs["xla"].astype(jnp.float32) - out.astype(jnp.float32))))
               for name, out in outs.items() if name != "xla")
    seconds = {name: best_seconds(lambda fn=fn: fn(q, k, v, positions), args.repeats) for name, fn in paths.items()}
    per_position = 2 * args.kv_heads * args.head_dim * dtype.itemsize * args.layers  # keys and values, every layer
    live = float(np.sum(np.asarray(positions) + 1)) * per_position
    whole = args.rows * args.max_len * per_position
    bandwidth = copy_bandwidth_gbs(1 << 30 if backend != "cpu" else 1 << 26)
    roof = live / (bandwidth * 1e9)
    device = jax.devices()[0].device_kind
    print(f"{args.rows} rows x {args.max_len} positions, {args.layers} layers, heads {args.heads} / {args.kv_heads} "
          f"of {args.head_dim}, {args.dtype}; mean context {float(np.mean(np.asarray(positions) + 1)):.0f} "
          f"({live / whole:.1%} of the cache live); {device}, copy bandwidth {bandwidth:.1f} GB/s")
    print(f"{'path':8s} {'step (all layers)':>18s} {'per layer':>10s} {'roofline share':>15s}")
    for name, t in seconds.items():
        print(f"{name:8s} {t * 1e3:15.3f} ms {t / args.layers * 1e6:7.1f} us {roof / t:14.1%}")
    ratio = seconds["xla"] / seconds["kernel"]
    note = " (kernel in the interpreter: not a speed figure)" if args.interpret else ""
    default = default_tiling(args.rows, args.heads, args.kv_heads, args.max_len, args.head_dim)
    print(f"xla / kernel: {ratio:.2f}x{note}; the kernel's default tiling {default[1]}x{default[0]} (splits x block); "
          f"roofline {roof * 1e3:.3f} ms (live keys and values once); largest output difference {diff:.3g}")
    auto = None
    if not args.interpret:  # (the interpreter's times say nothing of what a GPU would choose)
        auto = choose_shape(args.rows, args.max_len, args.heads, args.kv_heads, args.head_dim, args.head_dim, dtype)
        print(f"decode_attention=auto takes {auto.describe()}")
    out = {"benchmark": "ragged_decode", "device": jax.devices()[0].platform, "device_kind": device,
           "dtype": args.dtype, "rows": args.rows, "max_len": args.max_len, "layers": args.layers,
           "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
           "mean_context": round(float(np.mean(np.asarray(positions) + 1)), 1), "live_share": round(live / whole, 4),
           "copy_bandwidth_gbs": float(f"{bandwidth:.4g}"), "roofline_ms": round(roof * 1e3, 4),
           "xla_ms": round(seconds["xla"] * 1e3, 4), "kernel_ms": round(seconds["kernel"] * 1e3, 4),
           "xla_roofline_share": round(roof / seconds["xla"], 4),
           "kernel_roofline_share": round(roof / seconds["kernel"], 4), "xla_over_kernel": float(f"{ratio:.3g}"),
           "max_abs_diff": float(f"{diff:.3g}"), "interpreted": bool(args.interpret),
           "default_tiling": f"{default[1]}x{default[0]}",
           "tilings_ms": {name: round(t * 1e3, 4) for name, t in seconds.items() if name not in ("xla", "kernel")},
           "auto": None if auto is None else auto.as_dict()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
