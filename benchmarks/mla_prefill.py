"""Latent attention's prefill (DeepSeek-V2 / V3): the expanded form against the absorbed form, same device, same
dtype, same prompt and weights.

A prefill into an empty KV cache (the sampler's prompts, and the recompute of interrupted sequences after a weight
update) runs `Transformer.hidden(..., fresh=True)`: each head's keys and values are expanded from the latent, as in
training, and attention scores nope + rope = 192 dimensions and mixes v = 128 per pair; the cache still receives only
the latent. The baseline is the absorbed form the decode steps use (fresh=False): the key weights folded into each
query, scoring and mixing the 576-wide latent row per pair (Rkv + rope, then Rkv). The projections cost the same
either way (expanding the keys and values is the same product as absorbing into queries and out of outputs), so the
difference is the attention itself, which grows with the prompt's length.

Per length the script prints the best wall time of each form, the ratio (absorbed / expanded: > 1 means the expanded
form is faster) and the attention FLOPs worked by hand: 2 * (T^2 / 2) * H * (dims scored + dims mixed) per layer
(XLA's cost analysis counts the cache attention's loop body once, so it cannot show them), beside the device's
measured matmul peak in the dtype. Ends with one JSON line.

    python benchmarks/mla_prefill.py                                   # V2-Lite's widths, 2 layers, float32 CPU
    python benchmarks/mla_prefill.py --lengths 1024,4096,16384 --dtype bfloat16 --layers 4   # on an accelerator
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import best_seconds, device_peak_gflops  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.models import Transformer, init_cache  # noqa: E402
from areal_jax.system.loadgen import shape_config  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="deepseek-v2-lite", choices=("deepseek-v2-lite",))
    p.add_argument("--layers", type=int, default=2, help="decoder layers (the first is dense, as V2-Lite's)")
    p.add_argument("--lengths", default="512,2048,4096", help="prompt lengths, comma-separated")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args(argv)


def attention_flops(cfg, t: int, expanded: bool) -> float:
    """Hand-worked attention FLOPs of one causal prefill of t tokens over the model's layers: t^2 / 2 pairs, each
    head scoring and mixing its widths (two FLOPs a multiply-add)."""
    m = cfg.mla
    per_pair = (m.nope + m.rope + m.v) if expanded else (m.kv_lora_rank + m.rope + m.kv_lora_rank)
    return 2.0 * (t * t / 2) * cfg.num_heads * per_pair * cfg.num_layers


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = shape_config(args.preset, max_len=max(lengths), dtype=args.dtype, param_dtype=args.dtype,
                       num_layers=args.layers)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    device = jax.devices()[0].device_kind
    peak = device_peak_gflops(args.dtype)
    print(f"{args.preset} widths, {args.layers} layers, {args.dtype}, on {jax.default_backend()} ({device}); "
          f"measured {args.dtype} matmul peak {peak:.0f} GFLOP/s")

    def program(fresh: bool, t: int):
        def run(state, tokens):
            m = nnx.merge(graphdef, state)
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], tokens.shape)
            h, cache = m.hidden(tokens, positions, cache=init_cache(cfg, 1, t), fresh=fresh)
            return h[:, -1], cache
        return jax.jit(run)

    rows = []
    print(f"{'tokens':>7} {'absorbed s':>11} {'expanded s':>11} {'ratio':>6} {'attention GFLOP abs / exp':>26}")
    for t in lengths:
        tokens = jnp.asarray(np.random.default_rng(t).integers(0, cfg.vocab_size, (1, t)), jnp.int32)
        row = {"tokens": t}
        for name, fresh in (("absorbed", False), ("expanded", True)):
            fn = program(fresh, t)
            row[f"{name}_attention_gflop"] = attention_flops(cfg, t, fresh) / 1e9
            row[f"{name}_s"] = best_seconds(lambda fn=fn: fn(state, tokens), repeats=args.repeats)
        row["ratio"] = row["absorbed_s"] / row["expanded_s"]
        rows.append(row)
        print(f"{t:>7} {row['absorbed_s']:>11.3f} {row['expanded_s']:>11.3f} {row['ratio']:>6.2f} "
              f"{row['absorbed_attention_gflop']:>15.1f} / {row['expanded_attention_gflop']:<8.1f}")
    out = {"benchmark": "mla_prefill", "preset": args.preset, "layers": args.layers, "dtype": args.dtype,
           "backend": jax.default_backend(), "device": device, "peak_gflops": peak, "rows": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
