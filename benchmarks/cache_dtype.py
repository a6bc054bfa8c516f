"""Decode-step time of the sampler's engine with a bfloat16 model, by the dtype its KV cache holds.

On the CPU the cache holds float32 whatever the compute dtype (`models.transformer.cache_dtype`): XLA:CPU
converts a 16-bit cache to float32 around every scatter into it and every attention read of it. This runs
the same engine, weights and prompts three ways in one process: a bf16 model over a bf16 cache (the compute
dtype, as before), the same bf16 model over the float32 cache it now gets, and a float32 model. Each fills
--slots slots, decodes --steps steps per dispatch and times the dispatches after one warm-up. Prints the
milliseconds per decode step, tokens/s and the ratios, and ends with ONE line of JSON.

    python benchmarks/cache_dtype.py                                  # ~1 min on 2 CPU cores
    python benchmarks/cache_dtype.py --slots 64 --max-len 4096 --layers 4
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import add_model_args, device_peak_gflops, model_config
from flax import nnx

from areal_jax.models import Transformer, paged_attention, transformer
from areal_jax.sampler import SamplingParams
from areal_jax.sampler.engine import Engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8, help="decode steps per dispatch")
    p.add_argument("--dispatches", type=int, default=5, help="timed dispatches per setting")
    return p.parse_args(argv)


def step_ms(args: argparse.Namespace, dtype: jnp.dtype, cache: str) -> float:
    """Milliseconds per decode step; cache "compute" holds the compute dtype, "auto" what cache_dtype picks."""
    cfg = model_config(args, dtype=dtype, param_dtype=dtype, max_position_embeddings=max(args.max_len, 4096))
    chosen = transformer.cache_dtype
    if cache == "compute":
        transformer.cache_dtype = paged_attention.cache_dtype = lambda c, backend=None: jnp.dtype(c.dtype)
    try:
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        _, params = nnx.split(model)
        engine = Engine(model, num_slots=args.slots, max_len=args.max_len)
        state = engine.insert_sequences(params, engine.init_decode_state(), list(range(args.slots)),
                                        [[1, 2, 3, 4]] * args.slots,
                                        [SamplingParams(max_new_tokens=args.max_len - 8)] * args.slots)
        keys = np.zeros((args.steps, 2), np.uint32)
        state, _ = engine.generate_steps(params, state, keys)  # compiles
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(args.dispatches):
            state, _ = engine.generate_steps(params, state, keys)
        jax.block_until_ready(state)
        held = jax.tree.leaves(state.cache)[0].dtype
        assert held == (jnp.dtype(dtype) if cache == "compute" else transformer.cache_dtype(cfg)), held
        return (time.perf_counter() - t0) / (args.dispatches * args.steps) * 1e3
    finally:
        transformer.cache_dtype = paged_attention.cache_dtype = chosen


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = jax.devices()[0]
    peak = device_peak_gflops("float32")
    print(f"{device.platform} ({device.device_kind}), float32 matmul peak {peak:.0f} GFLOP/s; {args.slots} slots x "
          f"{args.max_len} positions, {args.layers} layers, hidden {args.hidden}, k={args.steps}")
    runs = {"bf16_model_bf16_cache": step_ms(args, jnp.bfloat16, "compute"),
            "bf16_model_auto_cache": step_ms(args, jnp.bfloat16, "auto"),
            "f32_model": step_ms(args, jnp.float32, "auto")}
    for name, ms in runs.items():
        print(f"  {name:24s} {ms:8.2f} ms per step   {args.slots / ms * 1e3:9.0f} tok/s")
    ratio = runs["bf16_model_bf16_cache"] / runs["bf16_model_auto_cache"]
    print(f"bf16 model: the cache dtype chosen now is {ratio:.1f}x faster than a bf16 cache")
    report = {"device": device.device_kind, "platform": device.platform, "matmul_peak_gflops": round(peak, 1),
              "slots": args.slots, "max_len": args.max_len, "layers": args.layers, "hidden": args.hidden,
              **{f"{k}_ms": round(v, 3) for k, v in runs.items()}, "speedup": round(ratio, 2)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
