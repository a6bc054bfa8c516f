"""Pieces every benchmark shares: the machine's matmul peak, the model-size flags and the model they give."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from areal_jax.metrics import matmul_peak_gflops  # noqa: F401  (shared with the entry points)


def device_peak_gflops(dtype: str, repeats: int = 5) -> float:
    """The matmul peak a benchmark's figures are quoted against: a jitted n^3 product in `dtype`, n = 2048
    on a CPU and 8192 on accelerators (a smaller product leaves most of a GPU idle)."""
    import jax

    n = 2048 if jax.default_backend() == "cpu" else 8192
    return matmul_peak_gflops(n, repeats=repeats, dtype=dtype)


def add_model_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark model's size: the same defaults (5.25M parameters) in every benchmark."""
    p.add_argument("--hidden", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=4096)
    return p


def model_config(args: argparse.Namespace, **overrides):
    """The Qwen2-style benchmark model sized by `add_model_args`'s flags (no EOS: lengths are forced).
    `overrides` (e.g. max_position_embeddings, dtype) replace the defaults."""
    from areal_jax.testing import models as testing

    fields = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                  head_dim=args.hidden // args.heads, max_position_embeddings=4096, eos_token_id=None)
    fields.update(overrides)
    return testing.tiny_config("qwen2", **fields)


def toy_fields(shape: dict, layers: int) -> dict:
    """--toy: the ModelConfig fields that shrink a `system.loadgen.MODEL_SHAPES` entry to a size that runs in seconds
    on a CPU (the benchmarks' smoke tests), keeping its head layout and layer kinds: `layers` layers, 16 wide a head
    (hidden = heads x 16, intermediate = heads x 40), a 512-token vocabulary; a mixture of experts routes 2 of 4; a
    Qwen3.5's Gated DeltaNet heads at the same scale (4 key heads, 8 value heads of 16)."""
    heads = shape["num_heads"]
    fields = dict(vocab_size=512, num_layers=layers, head_dim=16, hidden_size=heads * 16, intermediate_size=heads * 40)
    if shape.get("num_experts"):
        fields.update(num_experts=4, num_experts_per_tok=2)
    if shape.get("architecture") == "nemotron_h":  # Mamba-2 mixers of 8 heads of 16 in 4 groups of 16, the second
        from areal_jax.models.config_checks import Mamba2  # layer attention's

        fields["mamba"] = Mamba2(heads=8, head_dim=16, state=16, groups=4, conv_kernel=4)
        fields["layer_types"] = tuple("full_attention" if i == 1 else "linear_attention" for i in range(layers))
    if shape.get("architecture") == "qwen3_5_text":
        from areal_jax.models.config_checks import LinearAttention

        fields["linear"] = LinearAttention(key_heads=4, value_heads=8, key_dim=16, value_dim=16, conv_kernel=4)
    return fields


def best_seconds(fn, repeats: int = 5) -> float:
    """Best wall time of `fn()` (its result waited for) over `repeats` runs, after one untimed run
    (`metrics.best_seconds`)."""
    from areal_jax.metrics import best_seconds as best

    return best(fn, repeats)


def raw_copy_seconds(nbytes: int, src, dst, repeats: int = 5) -> float:
    """Best time to copy one buffer of `nbytes` from device `src` to `dst` (a fresh buffer when they are
    the same), or to each device of a list `dst` in one call (a hand-off to several sampler replicas): the floor a
    weight hand-off of those bytes is compared with."""
    import jax
    import jax.numpy as jnp

    x = jax.device_put(jnp.zeros((max(1, nbytes // 4),), jnp.float32), src)
    if isinstance(dst, (list, tuple)):
        if len(dst) > 1 or dst[0] != src:
            return best_seconds(lambda: jax.device_put([x] * len(dst), list(dst), may_alias=False), repeats)
        dst = dst[0]
    if src == dst:
        copy = jax.jit(jnp.copy)
        return best_seconds(lambda: copy(x), repeats)
    return best_seconds(lambda: jax.device_put(x, dst, may_alias=False), repeats)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main_job(config: str, run_dir: str, overrides: list[str], env: dict | None = None) -> None:
    """One run of `python -m areal_jax.main --config=CONFIG` into run_dir, in its own process, with --config.KEY=VALUE
    overrides ("KEY=VALUE"); raises with its stderr's tail if it fails."""
    cmd = [sys.executable, "-m", "areal_jax.main", f"--config={config}", f"--config.run_dir={run_dir}"]
    cmd += [f"--config.{kv}" for kv in overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the run in {run_dir} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
