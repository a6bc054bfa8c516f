"""Sampler throughput on a long-tailed completion-length workload (like reasoning RL).

One run, same weights and prompts for every engine:
  (a) SamplerLoop: continuous batching, finished slots refilled at once;
  (b) the same Engine in static batches that wait for the longest member;
  (c) HF transformers generate (PyTorch, same checkpoint, same batch size).
Completion lengths are forced by per-request max_new_tokens drawn from a clipped log-normal (most
short, a few hit --max-new-tokens) with no stop tokens, so every engine generates exactly the same
tokens count. Prints tokens/s, the ratios a/b and a/c, the fraction of this machine's float32 matmul
peak each reaches (model FLOPs: 2 * params per token + attention over the real context), and ends
with one line of JSON.

    python benchmarks/sampler.py                   # small default model, a few minutes on 2 CPU cores
    python benchmarks/sampler.py --hidden 512 --layers 8 --skip-hf
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import load_hf_checkpoint, testing
from areal_jax.sampler import Engine, Request, SamplerLoop, SamplingParams
from common import add_model_args, matmul_peak_gflops, model_config


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--num-slots", type=int, default=64, help="decode slots = HF batch size")
    p.add_argument("--num-prompts", type=int, default=192)
    p.add_argument("--max-new-tokens", type=int, default=128, help="the long tail's cap")
    p.add_argument("--median-new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="leave out (c) when torch is unavailable")
    return p.parse_args()



def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and forced completion lengths (clipped log-normal, sigma 1)."""
    rng = np.random.default_rng(args.seed)
    lo, hi = args.prompt_len
    prompts = [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(args.num_prompts)]
    raw = np.exp(rng.normal(np.log(args.median_new_tokens), 1.0, size=args.num_prompts))
    lengths = np.clip(np.ceil(raw), 2, args.max_new_tokens).astype(int).tolist()
    return prompts, lengths


def workload_flops(cfg, prompts: list[list[int]], lengths: list[int]) -> float:
    """Model FLOPs of prefilling every prompt and generating every token (real context only)."""
    d, hq, hd, layers = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_layers
    per_layer = d * hd * (hq + 2 * cfg.num_kv_heads) + hq * hd * d + 3 * d * cfg.intermediate_size
    dense = 2 * (layers * per_layer + d * cfg.vocab_size)  # per token, incl. the unembedding
    total = 0.0
    for p, n in zip(prompts, lengths):
        ctx = np.arange(1, len(p) + n + 1, dtype=np.float64)  # context each token attends to
        total += (len(p) + n) * dense + 4.0 * layers * hq * hd * ctx.sum()
    return total


def warm_up(engine: Engine, params, max_prompt: int, seed: int) -> int:
    """Compile every program the timed runs use (batched and single prefill per bucket, one
    decode step); returns the number of programs compiled."""
    top = engine.bucket_for(max_prompt)
    for b in (b for b in engine.prefill_buckets if b <= top):
        sp = SamplingParams(temperature=1.0, max_new_tokens=2)
        state = engine.insert_sequences(params, engine.init_decode_state(), [0], [[5] * b], [sp])
        state = engine.insert(engine.prefill(params, [5] * b), state, 1, sp)
        state, result = engine.generate(params, state, jax.random.key(seed))
        result.to_host()
    return engine.compile_count


def run_continuous(engine: Engine, params, prompts, lengths, seed: int) -> tuple[float, dict]:
    loop = SamplerLoop(engine, params, seed=seed)
    t = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        loop.submit(Request(id=i, prompt=p, max_new_tokens=n, temperature=1.0))
    got = 0
    for _ in prompts:
        c = loop.get_completion(timeout=3600)
        assert c is not None and c.finish_reason == "length", c
        got += len(c.tokens)
    elapsed = time.perf_counter() - t
    stats = loop.stats()
    loop.stop()
    assert got == sum(lengths)
    return elapsed, stats


def run_static(engine: Engine, params, prompts, lengths, seed: int) -> float:
    t = time.perf_counter()
    state, key, got = engine.init_decode_state(), jax.random.key(seed), 0
    for start in range(0, len(prompts), engine.num_slots):
        chunk = list(zip(prompts, lengths))[start : start + engine.num_slots]
        for slot, (p, n) in enumerate(chunk):
            sp = SamplingParams(temperature=1.0, max_new_tokens=n)
            state = engine.insert(engine.prefill(params, p), state, slot, sp)
        while True:  # the batch waits for its longest member
            key, sub = jax.random.split(key)
            state, result = engine.generate(params, state, sub)
            r = result.to_host()
            got += int(r.valid.sum())
            if r.done.all():
                break
    assert got == sum(lengths)
    return time.perf_counter() - t


def run_hf(path: str, prompts, lengths, batch: int, seed: int) -> float:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None

    def generate(chunk_prompts, max_new):
        width = max(len(p) for p in chunk_prompts)
        ids = torch.zeros((len(chunk_prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(chunk_prompts):  # left padding
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
        assert out.shape[1] == width + max_new
        return out

    generate(prompts[:2], 2)  # warm-up
    t = time.perf_counter()
    for start in range(0, len(prompts), batch):
        generate(prompts[start : start + batch], max(lengths[start : start + batch]))
    return time.perf_counter() - t


def main() -> None:
    args = parse_args()
    cfg = model_config(args)
    prompts, lengths = make_workload(args, cfg.vocab_size)
    total_tokens = sum(lengths)
    flops = workload_flops(cfg, prompts, lengths)
    peak = matmul_peak_gflops()
    max_len = args.prompt_len[1] + args.max_new_tokens
    with tempfile.TemporaryDirectory() as path:
        testing.write_random_hf_checkpoint(path, cfg, seed=args.seed)
        model = load_hf_checkpoint(path)
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        print(f"model: {n_params / 1e6:.2f}M params, d={args.hidden}, layers={args.layers}, vocab={args.vocab}; "
              f"{len(prompts)} prompts, {total_tokens} tokens to generate (median {int(np.median(lengths))}, "
              f"max {max(lengths)}, {sum(n == args.max_new_tokens for n in lengths)} at the cap); "
              f"{args.num_slots} slots; jax {jax.__version__} on {jax.devices()[0].platform}")
        print(f"matmul peak: {peak:.1f} GFLOP/s (float32, jitted 2048^3)")
        engine = Engine(model, num_slots=args.num_slots, max_len=max_len)
        _, params = nnx.split(model)
        compiled = warm_up(engine, params, args.prompt_len[1], args.seed)

        t_a, stats = run_continuous(engine, params, prompts, lengths, args.seed)
        t_b = run_static(engine, params, prompts, lengths, args.seed)
        t_c = None if args.skip_hf else run_hf(path, prompts, lengths, args.num_slots, args.seed)

    def row(name: str, seconds: float | None) -> dict:
        if seconds is None:
            return {"tokens_per_s": None, "seconds": None, "frac_peak": None}
        tps, frac = total_tokens / seconds, flops / seconds / (peak * 1e9)
        print(f"  {name:<34} {seconds:8.2f} s  {tps:9.1f} tok/s  {100 * frac:5.1f}% of matmul peak")
        return {"tokens_per_s": round(tps, 1), "seconds": round(seconds, 3), "frac_peak": round(frac, 4)}

    print("results:")
    res = {"continuous": row("(a) continuous batching (SamplerLoop)", t_a),
           "static": row("(b) static batches, same engine", t_b),
           "hf": row("(c) HF transformers generate", t_c)}
    a_b = t_b / t_a
    a_c = None if t_c is None else t_c / t_a
    print(f"  a/b = {a_b:.2f}x (goal >= 1.5)" + ("" if a_c is None else f"   a/c = {a_c:.2f}x (goal >= 3)"))
    print(f"  loop: {stats['steps']} steps, mean slot occupancy {stats['mean_slot_occupancy']:.2f}, "
          f"programs compiled {stats['compile_count']} (after warm-up {compiled})")
    print(json.dumps({
        "benchmark": "sampler", "device": jax.devices()[0].platform, "cpu_count": os.cpu_count(),
        "params": int(n_params), "num_slots": args.num_slots, "num_prompts": len(prompts),
        "generated_tokens": total_tokens, "max_new_tokens": args.max_new_tokens, "peak_gflops": round(peak, 1),
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in res.items()},
        "frac_peak": {k: v["frac_peak"] for k, v in res.items()},
        "ratio_a_b": round(a_b, 3), "ratio_a_c": None if a_c is None else round(a_c, 3),
        "mean_slot_occupancy": round(stats["mean_slot_occupancy"], 3), "compile_count": stats["compile_count"],
    }))


if __name__ == "__main__":
    main()
