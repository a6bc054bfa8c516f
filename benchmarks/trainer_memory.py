"""Memory of one micro-step of the PPO update at a real model shape, from shapes alone (no accelerator needed).

For each micro_batch_tokens x remat x attention choice, on the workload of benchmarks/trainer.py's preset
(or one trajectory of --trajectory-len tokens), the packed micro-step shape [rows, row_length] that
trainer.batch would build, and two estimates:
  * residuals: bytes the forward hands to the backward (the distinct leaves of jax.vjp's closure of the
    micro-step objective, traced with abstract values; weights and their bf16 copies included). An upper
    bound of what a compiler keeps: XLA may recompute cheap elementwise results inside its fusions
    instead of storing them;
  * probe (--probe): what the job plans with (trainer.memory.activation_bytes): XLA's working memory of
    the micro-step program compiled for a 1- and a 2-layer copy of the model at one row of
    micro_batch_tokens, extended to every layer; with --compile, its ratio to the full-depth figure;
  * compiled (--compile): `memory_analysis()` of the jitted accumulate program (Trainer's micro-step:
    forward, backward, gradient accumulation) compiled for the default backend: temp bytes, plus its
    arguments and outputs. On the CPU this is XLA:CPU's plan: it drops rematerialisation's optimisation
    barriers and merges recomputed matmuls with the forward's, so remat does not lower it there; GPU
    and TPU compilers keep the recomputation.
Prints one line per combination and ends with ONE line of JSON.

    python benchmarks/trainer_memory.py --preset qwen2.5-0.5b --micro-batch-tokens 16384 65536 \
        --remat none full dots --attention dense flash
    python benchmarks/trainer_memory.py --preset qwen2.5-0.5b --trajectory-len 32768 --micro-batch-tokens 32768
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from trainer import PRESETS, bench_model_config, make_batch

from areal_jax.models.transformer import Transformer
from areal_jax.trainer import TrainerConfig
from areal_jax.trainer.layout import attention_weight, step_layout
from areal_jax.trainer.memory import activation_bytes
from areal_jax.trainer.optim import make_optimizer, make_schedule
from areal_jax.trainer.state import replicated, train_state_shardings
from areal_jax.trainer.update import LOSS_FIELDS, MODEL_FIELDS, build_update_fns, micro_step_objective

GiB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--remat", nargs="+", choices=("none", "full", "dots"), default=["none", "full"])
    p.add_argument("--attention", nargs="+", choices=("dense", "blocked", "flash"), default=["dense", "flash"])
    p.add_argument("--trajectory-len", type=int, help="one trajectory of this many tokens instead of the workload")
    p.add_argument("--logits-chunk", type=int, default=4096)
    p.add_argument("--compile", action="store_true", help="also compile the accumulate program (minutes each)")
    p.add_argument("--probe", action="store_true", help="also the job's estimate from 1- and 2-layer programs")
    p.add_argument("--scan-layers", action="store_true", help="the decoder layers as one scan (train.scan_layers)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    workload = PRESETS[args.preset]["workload"]
    for key in ("num_seqs", "prompt_len", "median_completion", "max_completion"):
        setattr(args, key, workload[key])
    args.toy = False
    return args


def step_shape(cfg, lengths: list[int], budget: int) -> tuple[int, int]:
    """[rows, row_length] of the micro-steps trainer.batch builds on one device for the model `cfg`."""
    shapes = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
    t, rows, _ = step_layout(lengths, 1, budget, attention_weight(cfg, n_params))
    return rows, t


def abstract_batch(rows: int, t: int) -> dict[str, jax.ShapeDtypeStruct]:
    ints = {"tokens", "positions", "segment_ids", "targets", "versions"}
    return {k: jax.ShapeDtypeStruct((rows, t), jnp.int32 if k in ints else jnp.float32)
            for k in (*MODEL_FIELDS, *LOSS_FIELDS)}


def estimate(cfg, tcfg: TrainerConfig, rows: int, t: int, compile_: bool, probe: bool = False) -> dict:
    graphdef, params, other = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    batch = abstract_batch(rows, t)
    version = jax.ShapeDtypeStruct((), jnp.int32)

    def residuals(p):
        def objective(p):
            return micro_step_objective(p, other, graphdef, batch_values, version_value, tcfg)[0]
        leaves = jax.tree.leaves(jax.vjp(objective, p)[1])
        return list({id(x): x for x in leaves}.values())  # an array saved for several uses counts once

    batch_values = {k: jnp.zeros(v.shape, v.dtype) for k, v in batch.items()}  # traced under eval_shape only
    version_value = jnp.zeros((), jnp.int32)
    res = jax.eval_shape(residuals, params)
    out = {"rows": rows, "row_length": t, "residual_bytes": int(sum(r.size * r.dtype.itemsize for r in res))}
    if compile_:
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
        tx = make_optimizer(tcfg)
        shardings = train_state_shardings(params, tx, mesh)
        fns = build_update_fns(graphdef, tcfg, tx, make_schedule(tcfg), shardings,
                               jax.tree.map(lambda _: replicated(mesh), other), mesh)
        grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
        sums = jax.eval_shape(fns.zero_metrics)
        start = time.perf_counter()
        mem = fns.accumulate.lower(params, other, grads, sums, batch, version).compile().memory_analysis()
        out.update(compiled_temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes),
                   output_bytes=int(mem.output_size_in_bytes), compile_s=round(time.perf_counter() - start, 1))
    if probe:
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
        start = time.perf_counter()
        out["probe_temp_bytes"] = activation_bytes(lambda c: Transformer(c, rngs=nnx.Rngs(0)), cfg, tcfg, mesh)
        out["probe_s"] = round(time.perf_counter() - start, 1)
        if "compiled_temp_bytes" in out:
            out["probe_over_compiled"] = round(out["probe_temp_bytes"] / max(1, out["compiled_temp_bytes"]), 4)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = bench_model_config(argparse.Namespace(**{**vars(args), "preset": args.preset}))
    results = []
    for budget, remat, attention in itertools.product(args.micro_batch_tokens, args.remat, args.attention):
        args.trajectory_len = args.trajectory_len  # make_batch reads it
        lengths = [tr.packed_len for tr in make_batch(args, cfg.vocab_size)]
        if max(lengths) > budget:
            print(f"micro_batch_tokens={budget}: the longest trajectory ({max(lengths)}) does not fit; skipped")
            continue
        rows, t = step_shape(cfg, lengths, budget)
        tcfg = TrainerConfig(micro_batch_tokens=budget, logits_chunk=args.logits_chunk, remat=remat, prox_mode="loglinear",
                             scan_layers=args.scan_layers,
                             attention=attention)
        r = {"micro_batch_tokens": budget, "remat": remat, "attention": attention,
             **estimate(cfg, tcfg, rows, t, args.compile, args.probe)}
        results.append(r)
        compiled = (f", compiled temp {r['compiled_temp_bytes'] / GiB:7.2f} GiB (args {r['argument_bytes'] / GiB:.2f}, "
                    f"{r['compile_s']} s to compile)") if "compiled_temp_bytes" in r else ""
        probe = (f", probe (1 + 2 layers, one row of {budget}) {r['probe_temp_bytes'] / GiB:7.2f} GiB in "
                 f"{r['probe_s']} s") if "probe_temp_bytes" in r else ""
        print(f"mbt {budget:6d} [{rows} x {t}] remat {remat:5s} attention {attention:6s}: residuals "
              f"{r['residual_bytes'] / GiB:7.2f} GiB{compiled}{probe}", flush=True)
    report = {"benchmark": "trainer_memory", "preset": args.preset, "dtype": args.dtype,
              "backend": jax.default_backend(), "trajectory_len": args.trajectory_len, "results": results}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
