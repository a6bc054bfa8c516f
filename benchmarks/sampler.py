"""Sampler throughput on a long-tailed completion-length workload (like reasoning RL).

One run, same weights and prompts for every engine:
  (a) SamplerLoop: continuous batching, dispatches of k decode steps, finished slots refilled from standby
      rows inside a dispatch (or between dispatches with --standby-rows 0);
  (b) the same Engine in static batches that wait for the longest member (same k);
  (c) HF transformers generate (PyTorch on the same device as JAX, same batch size, same dtype).
Completion lengths are forced by per-request max_new_tokens drawn from a clipped log-normal (most
short, a few hit --max-new-tokens) with no stop tokens, so every engine generates exactly the same
number of tokens. Prints tokens/s, the ratios a/b and a/c, the fraction of this machine's matmul
peak each reaches (float32 on a CPU; the compute dtype at 8192^3 on accelerators), and ends with one line of JSON.

--steady adds the RL situation: a queue that never empties (continuous submission), tokens/s and mean
slot occupancy over a window after a warm-up, the latency a weight update waits for a dispatch
boundary (updates published during the window, on_update="continue" so re-prefill is not counted),
the idle slot-steps a finished sequence leaves before its slot is refilled, and the bandwidth
roofline: every decode step must read the weights and the live KV cache once, so tokens/s can at most
be live rows / ((weight bytes + live KV bytes) / the device's measured copy bandwidth).

    python benchmarks/sampler.py                      # tiny model, a few minutes on 2 CPU cores
    python benchmarks/sampler.py --preset qwen2.5-0.5b --dtype bfloat16 --steady   # one accelerator
    python benchmarks/sampler.py --hidden 512 --layers 8 --skip-hf --decode-steps 1
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
from common import add_model_args, device_peak_gflops, model_config, toy_fields
from decode_roofline import bare_dispatch, copy_bandwidth_gbs, roofline, workload_flops
from flax import nnx
from hf_generate import run_hf

from areal_jax.models import load_hf_checkpoint
from areal_jax.sampler import Engine, Request, SamplerLoop, SamplingParams
from areal_jax.sampler.config import default_standby_rows, prompt_bucket
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.system.loadgen import MODEL_SHAPES, shape_config
from areal_jax.testing import models as testing

# Model shapes (areal_jax.system.loadgen.MODEL_SHAPES) and the workload that goes with each.
PRESETS = {
    "tiny": dict(model=None, dtype="float32", slots=64, prompts=192, median=16, cap=128, prompt_len=(8, 48)),
    "qwen2.5-0.5b": dict(model="qwen2.5-0.5b", dtype="bfloat16", slots=256, prompts=1024, median=256, cap=1024,
                         prompt_len=(64, 128)),
    "qwen2.5-1.5b": dict(model="qwen2.5-1.5b", dtype="bfloat16", slots=128, prompts=256, median=1024, cap=16384,
                         prompt_len=(64, 128)),
    "gemma3-1b": dict(model="gemma3-1b", dtype="bfloat16", slots=256, prompts=1024, median=256, cap=1024,
                      prompt_len=(64, 128)),
    "phi4-mini": dict(model="phi4-mini", dtype="bfloat16", slots=128, prompts=512, median=256, cap=1024,
                      prompt_len=(64, 128)),
    "granite3-moe-1b": dict(model="granite3-moe-1b", dtype="bfloat16", slots=256, prompts=1024, median=256, cap=1024,
                            prompt_len=(64, 128)),
    "gpt-oss-20b": dict(model="gpt-oss-20b", dtype="bfloat16", slots=128, prompts=512, median=256, cap=1024,
                        prompt_len=(64, 128)),
    "deepseek-v2-lite": dict(model="deepseek-v2-lite", dtype="bfloat16", slots=128, prompts=512, median=256,
                             cap=1024, prompt_len=(64, 128)),
    "qwen3.5-9b": dict(model="qwen3.5-9b", dtype="bfloat16", slots=128, prompts=512, median=256, cap=1024,
                       prompt_len=(64, 128)),
    "ministral3-8b": dict(model="ministral3-8b", dtype="bfloat16", slots=128, prompts=512, median=256, cap=1024,
                          prompt_len=(64, 128)),
    "nemotron-nano-9b-v2": dict(model="nemotron-nano-9b-v2", dtype="bfloat16", slots=128, prompts=512, median=256,
                                cap=1024, prompt_len=(64, 128)),
    "falcon-h1-0.5b": dict(model="falcon-h1-0.5b", dtype="bfloat16", slots=256, prompts=1024, median=256, cap=1024,
                           prompt_len=(64, 128)),
}
TOY_LAYERS = 4  # --toy (common.toy_fields): a Qwen3.5's three Gated DeltaNet layers and one of attention
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)  # sizes of the tiny preset
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="params and compute dtype (default: the preset's)")
    p.add_argument("--num-slots", type=int, help="decode slots = HF batch size (default: the preset's)")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--max-new-tokens", type=int, help="the long tail's cap")
    p.add_argument("--median-new-tokens", type=int)
    p.add_argument("--sigma", type=float, default=1.0, help="log-std of the lengths (0: every one at the median)")
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--decode-steps", type=int, default=4, help="k, decode steps per dispatch")
    p.add_argument("--no-fetch-behind", action="store_true", help="fetch each dispatch before issuing the next")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop (a) after this long and report what it generated (long generations)")
    p.add_argument("--standby-rows", type=int, default=None,
                   help="prefilled requests waiting on the device for a slot (sampler/standby.py); default as the "
                        "job's rollout.standby_rows: num_slots / 2 with k > 1, else 0")
    p.add_argument("--standby-len", type=int, default=None,
                   help="dense cache: longest prompt bucket a standby row holds (default as the job's: the bucket of "
                        "the longest prompt, RolloutConfig.for_prompts)")
    p.add_argument("--kv-cache", choices=("dense", "paged"), default="dense")
    p.add_argument("--page-size", type=int, default=16, help="positions per KV page (paged)")
    p.add_argument("--kv-pages", type=int, default=None, help="pages in the pool (paged; default slots x max_len)")
    p.add_argument("--kv-admission", choices=("reserve", "optimistic"), default="reserve",
                   help="paged: admit a sample when the pool holds its longest length (reserve) or its prompt and the "
                        "next dispatch (optimistic: samples are preempted and resumed when pages run short)")
    p.add_argument("--paged-attention", choices=("auto", "gather", "kernel"), default="auto",
                   help="paged cache: the faster of the two, timed on GPUs (auto, the job's default; gather on CPUs), "
                        "each row's pages gathered, or read in place by a Pallas kernel")
    p.add_argument("--decode-attention", choices=("auto", "xla", "kernel"), default="auto",
                   help="dense cache: the faster of the two, timed on GPUs (auto, the job's default; XLA elsewhere), "
                        "XLA's attention (every position on GPUs) or models/ragged_decode.py's kernel")
    p.add_argument("--skip-static", action="store_true")
    p.add_argument("--skip-hf", action="store_true", help="leave out (c) when torch is unavailable")
    p.add_argument("--hf-prompts", type=int, default=None, help="prompts given to HF (default: all)")
    p.add_argument("--steady", action="store_true", help="also measure the never-empty-queue steady state")
    p.add_argument("--warmup-seconds", type=float, default=10.0)
    p.add_argument("--steady-seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", metavar="DIR", help="with --steady: a jax.profiler trace of three bare dispatches")
    p.add_argument("--toy", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    for flag, key in (("dtype", "dtype"), ("num_slots", "slots"), ("num_prompts", "prompts"),
                      ("median_new_tokens", "median"), ("max_new_tokens", "cap"), ("prompt_len", "prompt_len")):
        if getattr(args, flag) is None:
            setattr(args, flag, preset[key])
    if args.decode_steps < 1:
        p.error(f"--decode-steps must be at least 1, got {args.decode_steps}.")
    if args.standby_rows is None:
        args.standby_rows = default_standby_rows(args.num_slots, args.decode_steps)
    if not 1 <= args.median_new_tokens <= args.max_new_tokens:
        p.error(f"--median-new-tokens ({args.median_new_tokens}) must lie in [1, --max-new-tokens].")
    return args


def build_config(args: argparse.Namespace):
    dtype, max_len = DTYPES[args.dtype], args.prompt_len[1] + args.max_new_tokens
    shape = PRESETS[args.preset]["model"]
    if shape is None:
        return model_config(args, dtype=dtype, param_dtype=dtype, max_position_embeddings=max(4096, max_len))
    fields = toy_fields(MODEL_SHAPES[shape], TOY_LAYERS) if args.toy else {}
    return shape_config(shape, max_len=max_len, dtype=args.dtype, param_dtype=args.dtype, **fields)


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and forced completion lengths (log-normal with log-std --sigma, clipped to [2, cap])."""
    rng = np.random.default_rng(args.seed)
    lo, hi = args.prompt_len
    prompts = [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(args.num_prompts)]
    raw = np.exp(rng.normal(np.log(args.median_new_tokens), args.sigma, size=args.num_prompts))
    lengths = np.clip(np.ceil(raw), 2, args.max_new_tokens).astype(int).tolist()
    return prompts, lengths


def warm_up(engine: Engine, params, prompt_len: tuple[int, int], k: int, seed: int) -> int:
    """Compile every program the timed runs use, for each bucket the prompt lengths reach: the static run's
    prefill, insert and k-step dispatch, and what a SamplerLoop runs (batched prefill, insert, standby
    staging, the dispatch with flat params, its key stream), by running a loop over more prompts of each
    bucket than its slots and standby rows hold. Returns the number of programs compiled."""
    low, top = engine.bucket_for(prompt_len[0]), engine.bucket_for(prompt_len[1])
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), k)))
    buckets = [b for b in engine.prefill_buckets if low <= b <= top]
    for b in buckets:
        sp = SamplingParams(temperature=1.0, max_new_tokens=2)
        state = engine.insert_sequences(params, engine.init_decode_state(), [0], [[5] * b], [sp])
        state = engine.insert(engine.prefill(params, [5] * b), state, 1, sp)
        state, result = engine.generate_steps(params, state, keys)
        result.to_host()
    loop = SamplerLoop(engine, params, seed=seed, decode_steps=k)
    per_bucket = engine.num_slots + getattr(engine, "standby_rows", 0) + engine.prefill_batch + 1
    for b in buckets:
        loop.pause()
        for i in range(per_bucket):  # distinct prompts: one batched prefill row each
            loop.submit(Request(id=(b, i), prompt=[5 + i % 50] * (b - 1) + [6 + i // 50], max_new_tokens=k + 1,
                                temperature=1.0))
        loop.resume()
        for _ in range(per_bucket):
            loop.get_completion(timeout=600)
    loop.stop()
    return engine.compile_count


def new_loop(engine: Engine, params, args: argparse.Namespace, **kw) -> SamplerLoop:
    return SamplerLoop(engine, params, seed=args.seed, decode_steps=args.decode_steps,
                       fetch_behind=not args.no_fetch_behind, **kw)


def run_continuous(engine: Engine, params, prompts, lengths, args) -> tuple[float, dict, int]:
    """(seconds, loop stats, tokens generated); stops early after --max-seconds."""
    loop = new_loop(engine, params, args)
    t = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        loop.submit(Request(id=i, prompt=p, max_new_tokens=n, temperature=1.0))
    got, deadline = 0, None if args.max_seconds is None else t + args.max_seconds
    for _ in prompts:
        c = loop.get_completion(timeout=3600 if deadline is None else max(0.0, deadline - time.perf_counter()))
        if c is None:
            break
        assert c.finish_reason == "length", c
        got += len(c.tokens)
    stats = loop.stats()
    elapsed = time.perf_counter() - t
    loop.stop(graceful=False)
    if deadline is None:
        assert got == sum(lengths)
    return elapsed, stats, stats["generated_tokens"]


def run_static(engine: Engine, params, prompts, lengths, args) -> float:
    t = time.perf_counter()
    state, key, got, k = engine.init_decode_state(), jax.random.key(args.seed), 0, args.decode_steps
    for start in range(0, len(prompts), engine.num_slots):
        chunk = list(zip(prompts, lengths))[start : start + engine.num_slots]
        for slot, (p, n) in enumerate(chunk):
            sp = SamplingParams(temperature=1.0, max_new_tokens=n)
            state = engine.insert(engine.prefill(params, p), state, slot, sp)
        while True:  # the batch waits for its longest member
            key, sub = jax.random.split(key)
            state, result = engine.generate_steps(params, state, np.asarray(jax.random.key_data(jax.random.split(sub, k))))
            r = result.to_host()
            got += int(r.valid.sum())
            if r.done.all():
                break
    assert got == sum(lengths)
    return time.perf_counter() - t


def run_steady(engine: Engine, params, prompts, lengths, args) -> dict:
    """Keep the queue non-empty; measure a window after a warm-up; publish weight updates during it."""
    loop = new_loop(engine, params, args, on_update="continue")
    slots, n_submitted, version = engine.num_slots, 0, 0

    def top_up() -> None:
        nonlocal n_submitted
        while loop.num_pending() < 2 * slots:
            i = n_submitted % len(prompts)
            loop.submit(Request(id=n_submitted, prompt=prompts[i], max_new_tokens=lengths[i], temperature=1.0))
            n_submitted += 1

    def pump(seconds: float, on_tick=None) -> int:
        end, finished = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            top_up()
            while loop.get_completion(timeout=0.0) is not None:
                finished += 1
            if on_tick is not None:
                on_tick()
            time.sleep(0.002)
        return finished

    pump(args.warmup_seconds)
    s0, t0 = loop.stats(), time.perf_counter()
    next_update = [t0 + args.steady_seconds / 5]

    def maybe_update() -> None:
        nonlocal version
        if time.perf_counter() >= next_update[0]:
            version += 1
            loop.update_params(params, version)
            next_update[0] += args.steady_seconds / 5

    finished = pump(args.steady_seconds, maybe_update)
    s1, t1 = loop.stats(), time.perf_counter()
    loop.stop(graceful=False)
    steps = s1["steps"] - s0["steps"]
    busy = s1["mean_slot_occupancy"] * s1["steps"] * slots - s0["mean_slot_occupancy"] * s0["steps"] * slots
    occupancy = busy / max(1, steps * slots)
    step_ms = 1e3 * (t1 - t0) / max(1, steps)
    idle_steps = (steps * slots - busy) / max(1, finished)
    return {"seconds": round(t1 - t0, 2), "tokens_per_s": round((s1["generated_tokens"] - s0["generated_tokens"]) / (t1 - t0), 1),
            "mean_slot_occupancy": round(occupancy, 4), "steps": steps, "step_ms": round(step_ms, 3),
            "dispatch_ms": round(1e3 * (t1 - t0) / max(1, s1["dispatches"] - s0["dispatches"]), 3),
            "finished": finished, "idle_slot_steps_per_finished": round(idle_steps, 2),
            "idle_ms_per_finished": round(idle_steps * step_ms, 2), "updates": s1["updates"],
            "update_latency_ms": round(1e3 * s1["update_latency_s"], 2),
            "update_latency_max_ms": round(1e3 * s1["update_latency_max_s"], 2),
            "preempted": s1["preempted"] - s0["preempted"]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = build_config(args)
    prompts, lengths = make_workload(args, cfg.vocab_size)
    total_tokens = sum(lengths)
    backend = jax.default_backend()
    # float32 on a CPU; the compute dtype elsewhere (a 2048 float32 product reads ~1/9 of an H200's bf16 peak).
    peak = device_peak_gflops("float32" if backend == "cpu" else args.dtype)
    bandwidth = copy_bandwidth_gbs(1 << 30 if backend != "cpu" else 1 << 28)
    max_len = args.prompt_len[1] + args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        if PRESETS[args.preset]["model"] is None:  # the tiny preset: one checkpoint for JAX and HF
            path = tmp
            testing.write_random_hf_checkpoint(path, cfg, seed=args.seed)
            model = load_hf_checkpoint(path, param_dtype=cfg.param_dtype, dtype=cfg.dtype)
        else:
            model = testing.random_model(cfg, seed=args.seed)
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        print(f"model: {args.preset}, {n_params / 1e6:.2f}M params, {args.dtype}; {len(prompts)} prompts, "
              f"{total_tokens} tokens to generate (median {int(np.median(lengths))}, max {max(lengths)}, "
              f"{sum(n == args.max_new_tokens for n in lengths)} at the cap); {args.num_slots} slots, "
              f"k={args.decode_steps} decode steps per dispatch; jax {jax.__version__} on {jax.devices()[0].device_kind}")
        print(f"matmul peak: {peak:.1f} GFLOP/s ({'float32, jitted 2048^3' if backend == 'cpu' else args.dtype + ', jitted 8192^3'}); "
              f"copy bandwidth {bandwidth:.1f} GB/s")
        if args.kv_cache == "paged":
            engine = PagedEngine(model, num_slots=args.num_slots, max_len=max_len, page_size=args.page_size,
                                 num_pages=args.kv_pages, attention=args.paged_attention, standby_rows=args.standby_rows,
                                 admission=args.kv_admission)
        else:
            standby_len = args.standby_len or prompt_bucket(max_len, args.prompt_len[1])
            engine = Engine(model, num_slots=args.num_slots, max_len=max_len, standby_rows=args.standby_rows,
                            standby_len=standby_len, decode_attention=args.decode_attention)
        print(f"decode attention: {engine.decode_choice.describe()}")
        _, params = nnx.split(model)
        del model
        compiled = warm_up(engine, params, tuple(args.prompt_len), args.decode_steps, args.seed)
        t_a, stats, tokens_a = run_continuous(engine, params, prompts, lengths, args)
        t_b = None if args.skip_static or args.max_seconds is not None else run_static(engine, params, prompts, lengths, args)
        steady = run_steady(engine, params, prompts, lengths, args) if args.steady else None
        if steady is not None:  # the same dispatch alone, every slot live at a context of the steady state
            steady["bare"] = bare_dispatch(engine, params, cfg.vocab_size, prompts, lengths, args.decode_steps)
        hf = None if args.skip_hf else run_hf(args, cfg, path, prompts, lengths, args.num_slots)

    flops_per_token = workload_flops(cfg, prompts, lengths) / total_tokens

    def row(name: str, seconds: float | None, tokens: int = total_tokens) -> dict:
        if seconds is None:
            return {"tokens_per_s": None, "seconds": None, "frac_peak": None}
        tps = tokens / seconds
        frac = tps * flops_per_token / (peak * 1e9)
        print(f"  {name:<38} {seconds:8.2f} s  {tps:10.1f} tok/s  {100 * frac:5.1f}% of matmul peak")
        return {"tokens_per_s": round(tps, 1), "seconds": round(seconds, 3), "frac_peak": round(frac, 4)}

    print("results:")
    res = {"continuous": row("(a) continuous batching (SamplerLoop)", t_a, tokens_a),
           "static": row("(b) static batches, same engine", t_b),
           "hf": row(f"(c) HF generate ({hf[2] if hf else '-'})", hf and hf[0], hf[1] if hf else 0)}
    ratio = lambda key: None if res[key]["tokens_per_s"] is None else res["continuous"]["tokens_per_s"] / res[key]["tokens_per_s"]  # noqa: E731
    a_b, a_c = ratio("static"), ratio("hf")
    print("  " + "   ".join(f"{n} = {v:.2f}x" for n, v in (("a/b", a_b), ("a/c", a_c)) if v is not None))
    print(f"  loop: {stats['steps']} steps in {stats['dispatches']} dispatches, mean slot occupancy "
          f"{stats['mean_slot_occupancy']:.3f}, programs compiled {stats['compile_count']} (after warm-up {compiled})")
    live = stats["mean_slot_occupancy"] * args.num_slots
    if steady is not None:
        live = steady["mean_slot_occupancy"] * args.num_slots
        print(f"  steady: {steady['tokens_per_s']:.1f} tok/s, occupancy {steady['mean_slot_occupancy']:.3f}, step "
              f"{steady['step_ms']:.2f} ms, update waits {steady['update_latency_ms']:.1f} ms (max "
              f"{steady['update_latency_max_ms']:.1f}), a finished slot idles {steady['idle_slot_steps_per_finished']:.1f} "
              f"steps ({steady['idle_ms_per_finished']:.1f} ms)")
        bare = steady["bare"]
        bare["roofline_ms"] = roofline(cfg, params, prompts, lengths, args.num_slots, bandwidth)["step_ms_at_bandwidth"]
        bare["steady_over_bare"] = round(steady["step_ms"] / bare["step_ms"], 3)
        print(f"  bare dispatch (no loop; {bare['rows']} rows live, contexts mean {bare['context_mean']:.0f}, max "
              f"{bare['context_max']}): {bare['step_ms']:.3f} "
              f"ms per step = {bare['step_ms'] / bare['roofline_ms']:.1f}x its roofline ({bare['roofline_ms']:.3f} ms); "
              f"the steady step is {bare['steady_over_bare']:.2f}x it")
    roof = roofline(cfg, params, prompts, lengths, live, bandwidth)
    measured = steady["tokens_per_s"] if steady else res["continuous"]["tokens_per_s"]
    roof["share"] = round(measured / roof["tokens_per_s"], 4)
    print(f"  roofline: {roof['bytes_per_step'] / 1e6:.1f} MB per step ({roof['weight_bytes'] / 1e6:.1f} MB weights, "
          f"{roof['live_rows']:.1f} live rows x {roof['mean_live_context']:.0f} positions of KV) at {bandwidth:.1f} GB/s "
          f"-> {roof['tokens_per_s']:.0f} tok/s; reached {100 * roof['share']:.1f}%")
    out = {
        "benchmark": "sampler", "preset": args.preset, "dtype": args.dtype, "device": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(), "params": int(n_params),
        "num_slots": args.num_slots, "num_prompts": len(prompts), "decode_steps": args.decode_steps,
        "standby_rows": args.standby_rows,
        "kv_cache": args.kv_cache, "kv_pages": getattr(engine, "num_pages", None), "kv_admission": args.kv_admission,
        "paged_attention": getattr(engine, "attention", None), "decode_attention": getattr(engine, "decode_attention", None),
        "decode_choice": engine.decode_choice.as_dict(),
        "fetch_behind": not args.no_fetch_behind, "generated_tokens": int(tokens_a),
        "max_new_tokens": args.max_new_tokens, "peak_gflops": round(peak, 1), "copy_bandwidth_gbs": float(f"{bandwidth:.4g}"),
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in res.items()},
        "frac_peak": {k: v["frac_peak"] for k, v in res.items()},
        "ratio_a_b": None if a_b is None else round(a_b, 3), "ratio_a_c": None if a_c is None else round(a_c, 3),
        "hf_device": hf[2] if hf else None, "mean_slot_occupancy": round(stats["mean_slot_occupancy"], 3),
        "compile_count": stats["compile_count"], "steady": steady, "roofline": roof,
    }
    print(json.dumps(out))
    if steady is not None and args.profile:  # last: a jax.profiler trace once crashed the next JAX call on a GPU
        bare_dispatch(engine, params, cfg.vocab_size, prompts, lengths, args.decode_steps, repeats=3,
                      profile=args.profile)
        print(f"trace of three bare dispatches: {args.profile} (python benchmarks/trace_top.py {args.profile})")
    return out


if __name__ == "__main__":
    main()
