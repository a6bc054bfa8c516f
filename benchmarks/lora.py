"""LoRA: hand-off bytes and time (full weights vs adapters only) and decode speed (merged vs unmerged).

    python benchmarks/lora.py                       # CPU: the 5.25M benchmark model, 4 host devices
    python benchmarks/lora.py --preset 0.5b         # Qwen2.5-0.5B shape (bf16 base; for a GPU host)
    python benchmarks/lora.py --preset 1.5b --train-memory   # + training memory, LoRA vs full fine-tuning

Prints (1) the bytes one hand-off moves at the 0.5B and the chosen shape, full weights against adapters
(computed from the shapes), (2) the measured time per hand-off: full weights through ParamChannel, adapters
through AdapterChannel (merged: adapters folded into a fresh sampler copy; unmerged: adapters only),
(3) decode tokens/s with merged weights against unmerged adapters, greedy, the same prompts and lengths,
and (4) with --train-memory, the peak device memory of one LoRA update against one full update. Also, at
each Qwen2.5 shape, the trainer state one device keeps (system.memory's plan, from shapes), LoRA against
full fine-tuning. The last line is one JSON object.
On a CPU, train and rollout slices are two halves of 4 forced host devices.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from areal_jax.runtime.host_devices import use_host_devices  # noqa: E402

use_host_devices(4, keep_count=True)  # CPU only; GPUs ignore it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from areal_jax.system.loadgen import MODEL_SHAPES  # noqa: E402
from benchmarks.common import add_model_args, best_seconds, matmul_peak_gflops, model_config  # noqa: E402

# Qwen2.5 shapes (areal_jax.system.loadgen.MODEL_SHAPES); tied embeddings.
QWEN = {size: {k: v for k, v in MODEL_SHAPES[f"qwen2.5-{size}"].items() if k != "architecture"}
        for size in ("0.5b", "1.5b")}


def byte_table(cfg, lcfg) -> dict:
    from areal_jax.models import lora

    full_f32, full_bf16 = cfg.num_params * 4, cfg.num_params * 2
    adapters = lora.adapter_bytes(cfg, lcfg)
    return {"params": cfg.num_params, "full_f32": full_f32, "full_bf16": full_bf16, "adapters_f32": adapters,
            "share_of_f32": adapters / full_f32, "share_of_bf16": adapters / full_bf16}


def planned_state(cfg, lcfg, base_dtype: str) -> dict:
    """Bytes the trainer keeps on one device between updates (system.memory's plan, from shapes): LoRA (adapters,
    their AdamW moments and gradients, the frozen base in `base_dtype`) against full fine-tuning (float32
    params, moments and gradients). Activations are not included (they need the target's compiler)."""
    from areal_jax.config import from_config_dict
    from areal_jax.runtime.mesh import MeshConfig, build_meshes
    from areal_jax.system.memory import model_builder, state_parts

    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    cfg = cfg.replace(param_dtype=jnp.float32)
    out = {}
    for name, enabled in (("lora", True), ("full", False)):
        lora_section = {"enabled": enabled, "rank": lcfg.rank, "alpha": lcfg.alpha, "targets": lcfg.targets,
                        "base_dtype": base_dtype}
        job = from_config_dict({"lora": lora_section})
        train, _ = state_parts(job, cfg, meshes, model_builder(job.lora if enabled else None, 0),
                               nnx.LoRAParam if enabled else nnx.Param)
        out[f"{name}_state_bytes"] = sum(train.values())
    return out


def handoff(model, lcfg, meshes, repeats: int, sampler_dtype) -> dict:
    from areal_jax.models import lora
    from areal_jax.system.lora_channel import AdapterChannel
    from areal_jax.system.params import ParamChannel
    from areal_jax.system.parts import rollout_source
    from areal_jax.trainer import Trainer, TrainerConfig

    def full_weights() -> tuple[float, int]:
        # Its own scope, so the merged copy is freed before the adapter channels are timed.
        plain_params = nnx.state(lora.merged_model(model, lcfg.scale), nnx.Param)
        full = ParamChannel.for_model(plain_params, meshes.rollout_mesh, dtype=sampler_dtype)
        seconds = best_seconds(lambda: full.publish(1, plain_params), repeats)
        return seconds, sum(x.nbytes for x in jax.tree.leaves(full.latest()[1]))

    out = {}
    out["full_s"], out["full_bytes"] = full_weights()
    trainer = Trainer(model, TrainerConfig(), meshes.train_mesh, wrt=nnx.LoRAParam)
    for mode in ("merged", "unmerged"):
        ch = AdapterChannel(trainer.params, meshes.rollout_mesh, scale=lcfg.scale, mode=mode, dtype=sampler_dtype)
        # What a job publishes: the trained adapters alone, held flat (system.parts.rollout_source).
        out[f"{mode}_s"] = best_seconds(lambda: ch.publish(1, **rollout_source(trainer, ch)), repeats)
        out["adapter_bytes"] = ch.last_bytes
    return out


def decode(model, lcfg, args) -> dict:
    from areal_jax.models import lora
    from areal_jax.sampler import generate_batch

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.cfg.vocab_size, int(n)).tolist() for n in rng.integers(8, 32, args.prompts)]
    kw = dict(max_new_tokens=args.new_tokens, temperature=0.0, num_slots=args.slots, decode_steps=args.decode_steps)
    models = {"merged": lora.merged_model(model, lcfg.scale, args.sampler_dtype),
              "unmerged": nnx.merge(lora.sampler_graphdef(model), nnx.state(model))}
    out = {}
    for name, m in models.items():
        generate_batch(m, prompts[: args.slots], **{**kw, "max_new_tokens": 4})  # compile
        t = time.perf_counter()
        done = generate_batch(m, prompts, **kw)
        dt = time.perf_counter() - t
        out[f"{name}_tok_s"] = sum(len(c.tokens) for c in done) / dt
        out[f"{name}_tokens"] = [list(c.tokens) for c in done]
    out["same_tokens"] = out.pop("merged_tokens") == out.pop("unmerged_tokens")
    return out


def train_memory(cfg, lcfg, args) -> dict:
    """Peak device bytes of one update (memory_stats where the backend has them), LoRA vs full."""
    from jax.sharding import Mesh

    from areal_jax.models import Transformer, lora
    from areal_jax.trainer import Trainer, TrainerConfig, Trajectory

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    rng = np.random.default_rng(0)
    trajs = [Trajectory(tokens=rng.integers(3, cfg.vocab_size, args.train_len), prompt_len=64,
                        behav_logp=np.full(args.train_len - 64, -2.0), versions=np.zeros(args.train_len - 64, np.int64),
                        advantage=float(rng.normal()), reward=0.0) for _ in range(args.train_seqs)]
    tcfg = TrainerConfig(micro_batch_tokens=args.train_len * 2, logits_chunk=1024)
    out = {}
    for name in ("lora", "full"):
        dev = jax.devices()[0]
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        if name == "lora":
            lora.apply_lora(model, lcfg, rngs=nnx.Rngs(1))
        trainer = Trainer(model, tcfg, mesh, wrt=nnx.LoRAParam if name == "lora" else nnx.Param)
        del model
        trainer.update(trajs)
        stats = dev.memory_stats() or {}
        out[f"{name}_peak_bytes"] = stats.get("peak_bytes_in_use")
        out[f"{name}_state_bytes"] = sum(x.nbytes for x in jax.tree.leaves(trainer.state)) + sum(
            x.nbytes for x in jax.tree.leaves(trainer._other))
        del trainer
        if hasattr(dev, "reset_memory_stats"):  # not on every backend: the LoRA run goes first for that reason
            try:
                dev.reset_memory_stats()
            except Exception:  # noqa: BLE001
                pass
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = add_model_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--preset", choices=("args",) + tuple(QWEN), default="args",
                   help="model shape: the --hidden/--layers flags, or a Qwen2.5 shape")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default="all")
    p.add_argument("--base-dtype", default="", choices=("", "float32", "bfloat16"))
    p.add_argument("--sampler-dtype", default=None, choices=(None, "float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=1)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--train-memory", action="store_true")
    p.add_argument("--train-len", type=int, default=1024)
    p.add_argument("--train-seqs", type=int, default=8)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from areal_jax.models import Transformer, lora
    from areal_jax.runtime.mesh import MeshConfig, build_meshes
    from areal_jax.testing.models import randomize_params

    args.sampler_dtype = {None: None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.sampler_dtype]
    lcfg = lora.LoRAConfig(rank=args.rank, alpha=args.alpha, targets=args.targets, base_dtype=args.base_dtype)
    print(f"backend {jax.default_backend()}, {len(jax.devices())} devices, matmul peak "
          f"{matmul_peak_gflops():.0f} GFLOP/s (float32)", flush=True)
    report = {"benchmark": "lora", "preset": args.preset, "rank": args.rank, "targets": args.targets,
              "backend": jax.default_backend(), "device": jax.devices()[0].device_kind}
    for name, shape in QWEN.items():
        t = byte_table(model_config(args, **shape), lcfg)
        print(f"[bytes] Qwen2.5-{name} shape, rank {args.rank} on {args.targets}: {t['params'] / 1e6:.1f}M params, "
              f"full weights {t['full_f32'] / 2**20:.0f} MiB f32 / {t['full_bf16'] / 2**20:.0f} MiB bf16, adapters "
              f"{t['adapters_f32'] / 2**20:.1f} MiB f32 = {100 * t['share_of_f32']:.2f}% of f32 weights, "
              f"{100 * t['share_of_bf16']:.2f}% of bf16 weights")
        plan = planned_state(model_config(args, **shape), lcfg, "bfloat16")
        print(f"[state] Qwen2.5-{name} shape, trainer state per device from shapes (before activations): LoRA "
              f"(bf16 base) {plan['lora_state_bytes'] / 2**30:.2f} GiB, full fine-tuning "
              f"{plan['full_state_bytes'] / 2**30:.2f} GiB ({plan['full_state_bytes'] / plan['lora_state_bytes']:.1f}x)")
        report[f"qwen2.5-{name}"] = {**t, **plan}
    cfg = model_config(args, **QWEN.get(args.preset, {}))
    t = byte_table(cfg, lcfg)
    print(f"[bytes] measured shape: {t['params'] / 1e6:.2f}M params, adapters {100 * t['share_of_f32']:.2f}% of f32")
    model = randomize_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(1))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, lora.LoRAProjection):
            node.lora_b.set_value(0.02 * jax.random.normal(jax.random.key(node.salt), node.lora_b.shape))
    n = len(jax.devices())
    meshes = build_meshes(MeshConfig(train_devices=n // 2, rollout_devices=n - n // 2) if n > 1
                          else MeshConfig(colocated=True))
    h = handoff(model, lcfg, meshes, args.repeats, args.sampler_dtype)
    report["handoff"] = h
    print(f"[hand-off] full weights {h['full_bytes'] / 2**20:.1f} MiB: {1e3 * h['full_s']:.1f} ms | adapters "
          f"{h['adapter_bytes'] / 2**20:.2f} MiB: merged {1e3 * h['merged_s']:.1f} ms "
          f"({h['full_s'] / h['merged_s']:.1f}x faster), unmerged {1e3 * h['unmerged_s']:.1f} ms "
          f"({h['full_s'] / h['unmerged_s']:.1f}x faster)", flush=True)
    if not args.skip_decode:
        d = decode(model, lcfg, args)
        report["decode"] = d
        print(f"[decode] {args.prompts} prompts x {args.new_tokens} tokens, {args.slots} slots: merged "
              f"{d['merged_tok_s']:.0f} tok/s, unmerged {d['unmerged_tok_s']:.0f} tok/s "
              f"(merged/unmerged {d['merged_tok_s'] / d['unmerged_tok_s']:.2f}x); same greedy tokens: "
              f"{d['same_tokens']}", flush=True)
    if args.train_memory:
        del model
        m = train_memory(cfg, lcfg, args)
        report["train_memory"] = m
        gib = lambda x: "n/a" if x is None else f"{x / 2**30:.2f} GiB"  # noqa: E731
        print(f"[train memory] {args.train_seqs} x {args.train_len} tokens: LoRA peak {gib(m['lora_peak_bytes'])}, "
              f"state {gib(m['lora_state_bytes'])} | full fine-tuning peak {gib(m['full_peak_bytes'])}, state "
              f"{gib(m['full_state_bytes'])}")
    print(json.dumps(report, default=float))


if __name__ == "__main__":
    main()
