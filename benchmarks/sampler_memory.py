"""Working memory of the sampler's programs at a real model shape, from shapes alone (no accelerator needed).

For the preset's sampler (benchmarks/sampler.py: slots, max_len, k decode steps) and its longest prefill
(max_len: a recompute after a weight update re-prefills in-flight sequences up to there), prints per program:
  * probe: what the job plans with (sampler.memory.program_bytes): XLA's working memory of the program
    compiled for a 2- and a 3-layer copy of the model, extended to every layer; the seconds it took;
  * full (--full): XLA's working memory of the full-depth program, and the probe's ratio to it;
  * unbounded (--unbounded): the longest prefill as it ran before its bounds (every query block at once,
    prefill_batch rows per call whatever the bucket), full depth.
All figures are `memory_analysis().temp_size_in_bytes` of programs compiled for the default backend, abstract
(nothing allocated). On the CPU the KV cache holds float32 whatever --dtype says (models.transformer.cache_dtype),
so a bfloat16 run there shows a float32 cache (a GPU's own analysis: the memory05 phase of gpu_session.sh). Ends
with ONE line of JSON.

    python benchmarks/sampler_memory.py --preset qwen2.5-1.5b --full --unbounded
    python benchmarks/sampler_memory.py --preset qwen2.5-0.5b --dtype float32 --full
    python benchmarks/sampler_memory.py --preset qwen2.5-1.5b --dtype float32 --accelerator-chunks --full --unbounded
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from sampler import DTYPES, PRESETS

from areal_jax.models import cache_attention
from areal_jax.sampler import engine as engine_module
from areal_jax.sampler import memory as sampler_memory
from areal_jax.sampler.config import RolloutConfig
from areal_jax.system.loadgen import shape_config

GiB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=[k for k in PRESETS if PRESETS[k]["model"]], default="qwen2.5-0.5b")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="params and compute dtype (default: the preset's)")
    p.add_argument("--num-slots", type=int, help="default: the preset's")
    p.add_argument("--max-len", type=int, help="default: the preset's longest prompt + its cap")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--on-update", choices=("recompute", "continue"), default="recompute")
    p.add_argument("--full", action="store_true", help="compile the full-depth programs too")
    p.add_argument("--unbounded", action="store_true", help="the longest prefill without its bounds, full depth")
    p.add_argument("--accelerator-chunks", action="store_true",
                   help="read the cache in the accelerators' chunks (one pass up to 8,192 positions) on any backend")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.accelerator_chunks:
        cache_attention.cache_chunk_size = lambda s, backend=None: min(s, cache_attention.ACCELERATOR_CACHE_CHUNK)
    preset = PRESETS[args.preset]
    dtype = DTYPES[args.dtype or preset["dtype"]]
    max_len = args.max_len or -(-(preset["prompt_len"][1] + preset["cap"]) // 128) * 128
    name = jnp.dtype(dtype).name
    cfg = shape_config(preset["model"], max_len=max_len, dtype=name, param_dtype=name)
    r = RolloutConfig(num_slots=args.num_slots or preset["slots"], group_size=1, max_len=max_len,
                      decode_steps=args.decode_steps, on_update=args.on_update).for_prompts(preset["prompt_len"][1])
    longest = sampler_memory.longest_prefill(r, preset["prompt_len"][1])
    device = jax.devices()[0]
    print(f"{args.preset} ({cfg.num_layers} layers, {jnp.dtype(dtype).name}) on {device.platform} "
          f"({device.device_kind}): {r.num_slots} slots x {max_len} positions, k={r.decode_steps}, "
          f"longest prefill {longest} tokens")
    report = {"preset": args.preset, "dtype": jnp.dtype(dtype).name, "device": device.device_kind,
              "accelerator_chunks": bool(args.accelerator_chunks or device.platform != "cpu"),
              "num_slots": r.num_slots, "max_len": max_len, "decode_steps": r.decode_steps, "longest_prefill": longest}
    for program in sampler_memory.PROGRAMS:
        t0 = time.perf_counter()
        probe = sampler_memory.program_bytes(r, cfg, None, program, longest=longest)
        seconds = time.perf_counter() - t0
        line = f"  {program:8s} probe {probe / GiB:8.3f} GiB ({seconds:.1f} s)"
        report[f"{program}_probe_bytes"], report[f"{program}_probe_s"] = probe, round(seconds, 2)
        if args.full:
            full = sampler_memory.program_temp_bytes(r, cfg, None, layers=cfg.num_layers, program=program,
                                                     longest=longest, kind="model")  # the model itself
            line += f"   full depth {full / GiB:8.3f} GiB   probe / full {probe / full:.3f}"
            report[f"{program}_full_bytes"] = full
        print(line, flush=True)
    if args.unbounded:
        block, rows_for = cache_attention.query_block_size, engine_module.Engine.prefill_rows_for
        cache_attention.query_block_size = lambda rows, queries, *a, **k: queries
        engine_module.Engine.prefill_rows_for = lambda self, bucket: self.prefill_batch
        try:
            before = sampler_memory.program_temp_bytes(r, cfg, None, layers=cfg.num_layers, program="prefill",
                                                       longest=longest, kind="model")
        finally:
            cache_attention.query_block_size, engine_module.Engine.prefill_rows_for = block, rows_for
        print(f"  prefill without its bounds (all queries at once, 8 rows per call): {before / GiB:.3f} GiB")
        report["prefill_unbounded_bytes"] = before
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
