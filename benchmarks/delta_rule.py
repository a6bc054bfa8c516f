"""The gated delta rule (Qwen3.5's Gated DeltaNet layers) in chunks against the same recurrence token by token.

`models.gated_deltanet.delta_rule` computes a row's outputs chunk by chunk (matrix products alone within each
chunk of --chunk tokens, the unit triangular system's inverse included; a scan carrying the [key_dim, value_dim]
state between chunks); the baseline is the recurrence as written, a `lax.scan` of `delta_step` over every token.
Both run forward and backward (the trainer's work) under `jax.jit` on the same float32 inputs of --rows rows of
--tokens tokens and --heads heads.

Prints, per path, the median and best time, tokens/s, the chunked path's speed-up and the share of this machine's
float32 matmul peak its matrix products reach (counted below as `chunked_flops`), checks both give the same outputs,
and ends with one JSON line.

    python benchmarks/delta_rule.py                      # about a minute on 2 CPU cores
    python benchmarks/delta_rule.py --tokens 8192 --heads 32
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import device_peak_gflops

from areal_jax.models.gated_deltanet import delta_rule, delta_step, l2_normalize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8, help="value heads (query / key heads repeated to them)")
    p.add_argument("--key-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def chunked_flops(b: int, t: int, h: int, dk: int, dv: int, c: int) -> float:
    """Multiply-adds x 2 of `delta_rule`'s forward: per chunk the two C x C score products (keys with keys,
    queries with keys), the unit triangular inverse (C s^2 per doubling level s), its
    product with the values and the decayed keys, the reads of the carried state
    (two [C, Dk] x [Dk, Dv]), the scores times the corrections and the state update; the backward counted as two
    forwards."""
    inverse = sum(c * s * s for s in (2 ** i for i in range(max(c - 1, 0).bit_length())))
    per_chunk = inverse + 2 * c * c * dk + c * c * (dv + dk) + 2 * c * dk * dv + c * c * dv + c * dk * dv
    return 3 * 2 * b * h * (t / c) * per_chunk


def scanned(q, k, v, g, beta):
    """The recurrence token by token: a lax.scan of `delta_step` (the baseline)."""
    def step(s, xs):
        o, s = delta_step(*xs, s)
        return s, o

    b, _, h, dk = k.shape
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    _, o = jax.lax.scan(step, jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1)


def timed(fn, args, repeats: int) -> list[float]:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    b, t, h, dk, dv = args.rows, args.tokens, args.heads, args.key_dim, args.value_dim
    rng = np.random.default_rng(args.seed)
    q = l2_normalize(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32)) / np.sqrt(dk)
    k = l2_normalize(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    g = jnp.asarray(-0.3 * np.abs(rng.normal(size=(b, t, h))), jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(b, t, h)))), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    paths = {"chunked": lambda *xs: delta_rule(*xs, chunk=args.chunk)[0], "token scan": scanned}
    outputs = {name: np.asarray(jax.jit(fn)(q, k, v, g, beta)) for name, fn in paths.items()}
    error = float(np.abs(outputs["chunked"] - outputs["token scan"]).max())
    device = jax.devices()[0].device_kind
    peak = device_peak_gflops("float32")
    print(f"device: {device} ({jax.default_backend()}), float32 matmul peak {peak:.0f} GFLOP/s; rows {b} x {t} tokens, "
          f"{h} heads, key {dk} / value {dv}, chunk {args.chunk}; forward + backward; outputs differ by {error:.2e}")
    result = dict(benchmark="delta_rule", device=device, peak_gflops=round(peak, 1), rows=b, tokens=t, heads=h, key_dim=dk, value_dim=dv,
                  chunk=args.chunk, max_output_difference=error)
    for name, fn in paths.items():
        grad = jax.jit(jax.value_and_grad(lambda q_, k_, v_, fn=fn: jnp.sum(fn(q_, k_, v_, g, beta) * w),
                                          argnums=(0, 1, 2)))
        times = timed(grad, (q, k, v), args.repeats)
        median, best = float(np.median(times)), min(times)
        key = name.replace(" ", "_")
        result[f"{key}_median_s"], result[f"{key}_best_s"] = round(median, 4), round(best, 4)
        result[f"{key}_tokens_per_s"] = round(b * t / median, 1)
        print(f"{name:>10}: median {median * 1e3:8.1f} ms, best {best * 1e3:8.1f} ms, {b * t / median:10,.0f} tokens/s")
    result["speedup"] = float(f"{result['token_scan_median_s'] / result['chunked_median_s']:.3g}")
    flops = chunked_flops(b, t, h, dk, dv, args.chunk)
    result["chunked_peak_fraction"] = round(flops / result["chunked_median_s"] / 1e9 / peak, 4)
    print(f"chunked / token scan: {result['speedup']:.2f}x; the chunked path's products reach "
          f"{result['chunked_peak_fraction']:.1%} of the matmul peak")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
