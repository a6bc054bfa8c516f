"""One mixture-of-experts feed-forward (models.moe.MoE), forward + backward, on its expert paths and against
transformers' own block (Qwen3MoeSparseMoeBlock, eager PyTorch) on the same device, in the same precision, on the
same tokens and weights.

- blocked: tokens sorted into expert-aligned blocks, a scan over the blocks (the top-k work plus padding);
- ragged: tokens sorted by expert through jax.lax.ragged_dot (the top-k work where the backend groups it);
- pallas: the blocked layout through one grouped-matmul Pallas kernel (models.grouped_matmul), no scan; GPU only by
  default (elsewhere it runs in the Pallas interpreter);
- dense: every expert on every token, weighted (num_experts / top_k times the work, static shapes);
- torch: HF's block, a Python loop over the experts that received tokens (index_add into the output).

Each is timed as a jitted (JAX) or eager (PyTorch) step computing the layer's output and the gradients of a fixed
projection of it with respect to the input and every weight; with --forward-only, the output alone (a decode step's
work: a few hundred tokens, one per sequence). The figures: median ms per step, tokens/s, and the TFLOP/s of the
*active* work (the top-k experts' matmuls and the router, x3 for forward + backward) with its share of the measured
matmul peak of the dtype. Ends with one JSON line.

    python benchmarks/moe.py                                  # small shape, CPU float32, ~1 min
    python benchmarks/moe.py --preset qwen3-30b-a3b --dtype bfloat16 --tokens 16384   # one layer at Qwen3-30B-A3B's shape
    python benchmarks/moe.py --tokens 256 --forward-only      # a decode step's shape: which path serves the sampler
    python benchmarks/moe.py --lora-rank 16                   # + expert adapters, factored against folded
    python benchmarks/moe.py --impls blocked --max-blocks 256,512   # + larger blocks than the default 128 rows

At the qwen3-30b-a3b shape on a 24 GiB CPU host, run one path per process (--impls blocked, then dense, then torch):
the layer's float32 weights and gradients are 4.8 GiB a path, and the paths one after another in one process were
killed for memory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import device_peak_gflops  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.models import expert_paths as moe_module  # noqa: E402
from areal_jax.models.lora import LoRAConfig, LoRAExperts, merge_experts  # noqa: E402
from areal_jax.models.moe import MoE  # noqa: E402
from areal_jax.testing.models import tiny_config  # noqa: E402

PRESETS = {  # hidden, experts, top-k, expert width, renormalised
    "small": (512, 16, 4, 256, True),
    "qwen3-30b-a3b": (2048, 128, 8, 768, True),
    "mixtral-8x7b": (4096, 8, 2, 14336, True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=tuple(PRESETS))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--forward-only", action="store_true", help="time the output alone (a decode step), no gradients")
    p.add_argument("--max-blocks", default="",
                   help="comma-separated largest block sizes (rows) to also time the blocked and pallas paths with, as "
                        "blocked@N (default: the model's, models.expert_paths.MAX_EXPERT_BLOCK)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="also time each JAX path with LoRA adapters of this rank on the experts (gradients of the "
                        "adapters and the input only): the factored form the model runs (lora+) against the adapters "
                        "folded into the weights first (lora-folded+)")
    p.add_argument("--impls", default="",
                   help="comma-separated subset of blocked, pallas, ragged, dense, torch (default: all; pallas on GPUs only; "
                        "on a CPU, ragged only "
                        "where its expansion to every expert stays under 2 GiB)")
    return p.parse_args(argv)


def layer_weights(preset: str, seed: int = 0) -> dict[str, np.ndarray]:
    d, e, _, f, _ = PRESETS[preset]
    rng = np.random.default_rng(seed)
    return {"router": rng.normal(size=(d, e)).astype(np.float32) / np.sqrt(d),
            "gate": rng.normal(size=(e, d, f)).astype(np.float32) / np.sqrt(d),
            "up": rng.normal(size=(e, d, f)).astype(np.float32) / np.sqrt(d),
            "down": rng.normal(size=(e, f, d)).astype(np.float32) / np.sqrt(f)}


def active_flops(preset: str, tokens: int, forward_only: bool = False) -> float:
    """Forward + backward (or forward only) matmul FLOPs of the work a token really needs: its k experts and the
    router."""
    d, e, k, f, _ = PRESETS[preset]
    return (1 if forward_only else 3) * tokens * (2 * d * e + k * 3 * 2 * d * f)


def _median_ms(step, repeats: int) -> float:
    step()  # compile / warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


EXPERT_WEIGHTS = {"experts_gate": "gate", "experts_up": "up", "experts_down": "down"}


def lora_factors(args, w: dict) -> dict:
    """Per expert weight, adapters (a, b) of --lora-rank: a as LoRA initialises it, b nonzero (a trained adapter)."""
    rng = np.random.default_rng(2)
    out = {}
    for name, key in EXPERT_WEIGHTS.items():
        e, fan_in, fan_out = w[key].shape
        out[name] = (rng.uniform(-1, 1, (e, fan_in, args.lora_rank)).astype(np.float32) / np.sqrt(fan_in),
                     rng.normal(size=(e, args.lora_rank, fan_out)).astype(np.float32) * 0.02)
    return out


def time_jax(impl: str, args, w: dict, x: np.ndarray, probe: np.ndarray, lora_mode: str | None = None,
             ) -> tuple[float, np.ndarray, float]:
    """(median ms, the layer's output, the compiled step's temporary device memory in MiB). lora_mode: "factored"
    (the experts as lora.LoRAExperts, which the layer multiplies through the factors) or "folded" (the adapters
    merged into the weights inside the step, then the plain layer): gradients of the adapters and x only."""
    d, e, k, f, renorm = PRESETS[args.preset]
    dtype = jnp.dtype(args.dtype)
    cfg = tiny_config("qwen3_moe", hidden_size=d, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=f,
                      norm_topk_prob=renorm, moe_impl=impl, dtype=dtype, param_dtype=dtype)
    layer = nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(layer)
    values = {"router": w["router"], **{name: w[key] for name, key in EXPERT_WEIGHTS.items()}}
    state = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.asarray(values[path[0].key], dtype), state)
    factors = lora_factors(args, w) if lora_mode else {}
    scale = 2.0  # alpha / rank with alpha = 2 * rank
    if lora_mode == "factored":
        layer = nnx.merge(graphdef, state)
        for name in EXPERT_WEIGHTS:
            base = getattr(layer, name)
            adapted = LoRAExperts(base, LoRAConfig(rank=args.lora_rank, alpha=scale * args.lora_rank),
                                  rngs=nnx.Rngs(0))
            adapted.lora_a.set_value(jnp.asarray(factors[name][0]))
            adapted.lora_b.set_value(jnp.asarray(factors[name][1]))
            setattr(layer, name, adapted)
        graphdef, frozen, train = nnx.split(layer, nnx.Not(nnx.LoRAParam), nnx.LoRAParam)
    elif lora_mode == "folded":
        frozen, train = state, {name: tuple(map(jnp.asarray, ab)) for name, ab in factors.items()}
    else:
        frozen, train = None, state

    def run(fz, tr, xx):
        if lora_mode == "factored":
            return nnx.merge(graphdef, fz, tr)(xx)
        if lora_mode == "folded":
            st = jax.tree_util.tree_map_with_path(
                lambda path, leaf: merge_experts(leaf, *tr[path[0].key], scale, dtype)
                if path[0].key in tr else leaf, fz)
            return nnx.merge(graphdef, st)(xx)
        return nnx.merge(graphdef, tr)(xx)

    @jax.jit
    def step(fz, tr, xx):
        out = run(fz, tr, xx)
        if args.forward_only:
            return (out,)
        return out, jax.grad(lambda tr, xx: jnp.sum(run(fz, tr, xx).astype(jnp.float32) * probe),
                             argnums=(0, 1))(tr, xx)

    xj = jnp.asarray(x, dtype)
    ms = _median_ms(lambda: jax.block_until_ready(step(frozen, train, xj)), args.repeats)
    temp = step.lower(frozen, train, xj).compile().memory_analysis()
    temp_mib = temp.temp_size_in_bytes / 2**20 if temp is not None else float("nan")
    return ms, np.asarray(step(frozen, train, xj)[0], np.float32), temp_mib


def time_torch(args, w: dict, x: np.ndarray, probe: np.ndarray) -> tuple[float, np.ndarray] | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    d, e, k, f, renorm = PRESETS[args.preset]
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"  # the device JAX runs on
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    config = transformers.Qwen3MoeConfig(hidden_size=d, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=f,
                                         norm_topk_prob=renorm, num_attention_heads=8, num_key_value_heads=8)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(w["router"].T.copy()))
        block.experts.gate_up_proj.copy_(torch.from_numpy(
            np.concatenate([w["gate"], w["up"]], axis=2).transpose(0, 2, 1).copy()))
        block.experts.down_proj.copy_(torch.from_numpy(w["down"].transpose(0, 2, 1).copy()))
    block = block.to(device=device, dtype=dtype)
    xt = torch.from_numpy(x).to(device=device, dtype=dtype)[None].requires_grad_(True)
    pt = torch.from_numpy(probe).to(device=device)[None]

    def step():
        for p in (*block.parameters(), xt):
            p.grad = None
        if args.forward_only:
            with torch.no_grad():
                out = block(xt)
        else:
            out = block(xt)
            (out.float() * pt).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    ms = _median_ms(step, args.repeats)
    return ms, step()[0].detach().float().cpu().numpy()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    d, e, k, f, _ = PRESETS[args.preset]
    w = layer_weights(args.preset)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(args.tokens, d)).astype(np.float32)
    probe = rng.normal(size=(args.tokens, d)).astype(np.float32)
    peak = device_peak_gflops(args.dtype)
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    print(f"MoE layer {args.preset}: hidden {d}, {e} experts, top {k}, width {f}; {args.tokens} tokens, {args.dtype}, "
          f"{device}; {args.dtype} matmul peak {peak:.0f} GFLOP/s; "
          f"{'forward only' if args.forward_only else 'forward + backward'}")
    flops = active_flops(args.preset, args.tokens, args.forward_only)
    results, outputs = {}, {}
    impls = args.impls.split(",") if args.impls else ["blocked", "pallas", "ragged", "dense", "torch"]
    if not args.impls and jax.default_backend() != "gpu":
        impls.remove("pallas")
        print("  pallas  skipped: its kernel is written for GPUs and runs in the Pallas interpreter elsewhere (slow); "
              "--impls pallas runs it anyway")
    expanded = args.tokens * k * e * f * jnp.dtype(args.dtype).itemsize  # XLA:CPU's ragged_dot: [pairs, E * F]
    if not args.impls and jax.default_backend() == "cpu" and expanded > 2 << 30:
        impls.remove("ragged")
        print(f"  ragged  skipped: XLA:CPU expands ragged_dot to every expert ({expanded / 2**30:.1f} GiB per product "
              "here); --impls ragged runs it anyway")
    runs = [(impl, impl, None, None) for impl in impls]
    runs += [(f"{impl}@{cap}", impl, None, int(cap)) for cap in filter(None, args.max_blocks.split(","))
             for impl in impls if impl in ("blocked", "pallas")]
    if args.lora_rank:
        print(f"  lora+PATH: rank-{args.lora_rank} adapters on the experts, multiplied through their factors; "
              "lora-folded+PATH: merged into the weights first (gradients: adapters and input)")
        runs += [(f"{prefix}+{impl}", impl, mode, None) for impl in impls if impl != "torch"
                 for prefix, mode in (("lora-folded", "folded"), ("lora", "factored"))]
    failed, lora_outputs = {}, {}
    width = max(len(name) for name, _, _, _ in runs)
    for name, impl, mode, cap in runs:
        default_cap = moe_module.MAX_EXPERT_BLOCK
        moe_module.MAX_EXPERT_BLOCK = cap or default_cap  # read when the step is traced
        try:  # one path failing (out of memory, a kernel that does not lower) leaves the others' figures
            got = time_torch(args, w, x, probe) if impl == "torch" else time_jax(impl, args, w, x, probe, mode)
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {name:{width}s} failed: {failed[name]}")
            continue
        finally:
            moe_module.MAX_EXPERT_BLOCK = default_cap
        if got is None:
            print(f"  {name:{width}s} skipped (no torch / transformers)")
            continue
        ms, out, temp_mib = got if len(got) == 3 else (*got, None)
        (lora_outputs if mode else outputs)[name] = out
        results[name] = {"ms": ms, "tokens_per_s": args.tokens / ms * 1e3,
                         "active_tflops": flops / ms / 1e9, "share_of_peak": flops / ms / 1e6 / peak,
                         "temp_mib": temp_mib}
        r = results[name]
        memory = "" if temp_mib is None else f"  temp memory {temp_mib:8.1f} MiB"
        print(f"  {name:{width}s} {ms:9.1f} ms  {r['tokens_per_s']:10.0f} tok/s  "
              f"active {r['active_tflops']:7.3f} TFLOP/s "
              f"({100 * r['share_of_peak']:.1f}% of peak){memory}")
    ref = outputs.get("dense", next(iter(outputs.values()), None))
    errors = {name: float(np.abs(out - ref).max()) for name, out in outputs.items()} if ref is not None else {}
    pairs = [("blocked", "dense"), ("ragged", "dense"), ("pallas", "blocked"), ("blocked", "torch"),
             ("pallas", "torch"), ("ragged", "torch"), ("dense", "torch")]
    pairs += [(f"lora+{impl}", f"lora-folded+{impl}") for impl in impls]
    pairs += [(name, name.split("@")[0]) for name, _, _, cap in runs if cap]  # a block size against the default
    ratios = {f"{a}_over_{b}": results[b]["ms"] / results[a]["ms"] for a, b in pairs if a in results and b in results}
    for impl in impls:  # the factored adapters against the folded ones, same path
        a, b = f"lora+{impl}", f"lora-folded+{impl}"
        if a in lora_outputs and b in lora_outputs:
            errors[a] = float(np.abs(lora_outputs[a] - lora_outputs[b]).max())
            if results[a]["temp_mib"] and results[b]["temp_mib"]:
                ratios[f"{a}_memory_over_{b}"] = results[a]["temp_mib"] / results[b]["temp_mib"]
    for name, value in ratios.items():
        what = "memory" if "_memory_over_" in name else "speed"
        print(f"  {what} {name.replace('_memory_over_', ' / ').replace('_over_', ' / ')}: {value:.2f}x")
    print(f"  outputs: max |difference| to the dense path (lora+PATH: to lora-folded+PATH) {errors}")
    summary = {"benchmark": "moe", "preset": args.preset, "tokens": args.tokens, "dtype": args.dtype, "device": device,
               "forward_only": args.forward_only, "lora_rank": args.lora_rank,
               "peak_gflops": peak, "results": results, "ratios": ratios, "max_abs_diff": errors, "failed": failed}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
