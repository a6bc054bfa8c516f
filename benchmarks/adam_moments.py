"""The optimizer step with AdamW's moments in float32 against bfloat16 (train.moment_dtype, trainer/low_precision.py).

One jitted step of the job's optimizer (`make_optimizer`: clipping, AdamW with weight decay) over float32 params
shaped like a preset's (Qwen2.5-0.5B's by default: embedding, 24 layers' matrices, norms and biases), params and
state donated as the trainer's update does. Both runs take the same gradients on the same device. The step reads
the params, gradients and moments and writes params and moments: 28 bytes a parameter with float32 moments, 20 with
bfloat16 ones, so where the step is bound by memory bandwidth bfloat16 should be faster, while its rounding (a hash
and a few integer operations an element) costs arithmetic. Prints each step's time, the bytes of state, the share of
the copy bandwidth measured in the same run (on a CPU one jitted copy runs on one thread, so the share means little
there), the ratio, and one JSON line.

    python benchmarks/adam_moments.py                       # 0.5B's shapes (~6 GB of host memory on a CPU)
    python benchmarks/adam_moments.py --preset qwen2.5-1.5b
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from common import best_seconds, raw_copy_seconds

from areal_jax.system import loadgen
from areal_jax.trainer import TrainerConfig, make_optimizer
from areal_jax.trainer.memory import resident_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(loadgen.MODEL_SHAPES))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args(argv)


def shapes(preset: str, layers: int | None) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Qwen2-style decoder of the preset's widths."""
    cfg = loadgen.shape_config(preset, max_len=4096, dtype="bfloat16")
    d, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    out = {"embed": (cfg.vocab_size, d), "final_norm": (d,)}
    for i in range(cfg.num_layers if layers is None else layers):
        out |= {f"{i}.q": (d, cfg.num_heads * cfg.head_dim), f"{i}.kv": (d, 2 * kv), f"{i}.o": (d, d),
                f"{i}.up_gate": (d, 2 * f), f"{i}.down": (f, d), f"{i}.bias": (d + 2 * kv,), f"{i}.norms": (2, d)}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (d, cfg.vocab_size)
    return out


def step_seconds(moment_dtype: str, params: dict, grads: dict, repeats: int) -> tuple[float, int]:
    tx = make_optimizer(TrainerConfig(lr=1e-5, weight_decay=0.01, moment_dtype=moment_dtype), 100)
    state = jax.jit(tx.init)(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (jax.tree.map(jnp.add, p, u), s))(*tx.update(g, s, p)),
                   donate_argnums=(0, 1))
    held = {"p": jax.tree.map(jnp.copy, params), "s": state}

    def run():
        held["p"], held["s"] = step(held["p"], held["s"], grads)
        return held["p"]

    seconds = best_seconds(run, repeats)
    return seconds, resident_bytes(held["s"])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    dev = jax.devices()[0]
    keys = iter(jax.random.split(jax.random.key(0), 64 * 1024))
    sizes = shapes(args.preset, args.layers)
    params = {k: jax.random.normal(next(keys), s, jnp.float32) * 0.02 for k, s in sizes.items()}
    grads = {k: jax.random.normal(next(keys), s, jnp.float32) * 1e-3 for k, s in sizes.items()}
    n = sum(int(np.prod(s)) for s in sizes.values())
    copy = raw_copy_seconds(n * 4, dev, dev, args.repeats)
    bandwidth = 2 * n * 4 / copy  # a copy reads and writes its bytes
    print(f"{args.preset} shapes, {n / 1e6:.1f}M float32 params, on {dev.device_kind} ({dev.platform}); "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    rows = {}
    for dtype, moved in (("float32", 28), ("bfloat16", 20)):  # bytes a parameter read and written by a step
        seconds, state = step_seconds(dtype, params, grads, args.repeats)
        share = moved * n / seconds / bandwidth
        rows[dtype] = {"step_ms": round(seconds * 1e3, 3), "state_bytes": state,
                       "bytes_moved_per_param": moved, "bandwidth_share": round(share, 3)}
        print(f"moments {dtype:8s}: step {seconds * 1e3:8.2f} ms, state {state / 2**30:6.2f} GiB, "
              f"{moved} B a parameter moved at {share:.0%} of the copy bandwidth")
    ratio = rows["float32"]["step_ms"] / rows["bfloat16"]["step_ms"]
    print(f"bfloat16 moments: {ratio:.2f}x the float32 step's speed, "
          f"{rows['bfloat16']['state_bytes'] / rows['float32']['state_bytes']:.2f}x its state")
    out = {"benchmark": "adam_moments", "preset": args.preset, "device": dev.platform, "device_kind": dev.device_kind,
           "params": n, "copy_bandwidth_gbs": round(bandwidth / 1e9, 2), "float32": rows["float32"],
           "bfloat16": rows["bfloat16"], "speed_ratio_bf16_over_f32": round(ratio, 3)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
