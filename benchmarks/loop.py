"""The whole asynchronous loop at a given model size: eta = 0, 1, 4 and unbounded side by side.

    python benchmarks/loop.py --preset tiny                      # 2-core CPU: a few minutes
    python benchmarks/loop.py --preset qwen2.5-0.5b --steps 6    # one accelerator
    python benchmarks/loop.py --model /models/Qwen2.5-0.5B ...   # a local HF checkpoint

Each eta runs the real job (RLJob: controller, sampler loop, reward pool, buffer, trainer, param
channel) for --steps updates on synthetic prompts. Every request generates exactly a length drawn from
a long-tailed (log-normal) distribution with the given median and cap, with no stop token, and a
Bernoulli reward (a hash of the completion) keeps the advantages non-zero. A preset's random logits are
tempered to --entropy nats a token (otherwise a random model's samples of a group repeat each other and
score alike, and no update would change the weights); the table's last two columns show the trained
tokens' entropy and the share of groups that scored alike. Per eta: trained and
generated tokens/s (trained counts prompt + completion tokens; trained tokens/s after the first update too, the
rate a long run sees), mean slot occupancy over decode steps,
the share of wall time the trainer waited for data, staleness mean / max (from samples.jsonl), the
weight hand-off (publish time, publish -> first token generated at the new version, bytes), and
the seconds the run still spent tracing, compiling or loading programs from the
persistent cache (from JAX's monitoring events: read a ratio between etas with it), and
timeline.json in OUT/eta<k>/ (`python -m areal_jax.programs.report OUT/eta4` draws it). After the runs, the
hand-off of the same params is timed against a raw device copy of the same bytes. Memory per part (per
device, system.memory: the plan the job itself checks) is computed from shapes before anything is
allocated (with a clear error when it cannot fit) and read from the device's memory_stats where the
backend has them. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import best_seconds, matmul_peak_gflops, raw_copy_seconds  # noqa: E402
from loop_plan import job_plan  # noqa: E402

from areal_jax.system import loadgen  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_PROMPT_LEN = 64
# Time JAX spends tracing, lowering, compiling or fetching a program from the persistent cache, from its
# monitoring events: each measured run reports what it still compiled, so a ratio between etas can be
# read for what it is.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")
_COMPILE = {"s": 0.0, "backend_compiles": 0}


def _on_compile_event(event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS:
        _COMPILE["s"] += duration
        _COMPILE["backend_compiles"] += event == "/jax/core/compile/backend_compile_duration"


jax.monitoring.register_event_duration_secs_listener(_on_compile_event)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(loadgen.PRESETS), default="tiny")
    p.add_argument("--model", default="", help="a local HF checkpoint directory instead of a preset's random weights")
    p.add_argument("--steps", type=int, help="updates per eta (default: the preset's)")
    p.add_argument("--etas", default="0,1,4,unbounded", help="comma-separated; 'unbounded' for no bound")
    p.add_argument("--median", type=int, help="median generation length (tokens)")
    p.add_argument("--cap", type=int, help="longest generation (tokens)")
    p.add_argument("--sigma", type=float, default=1.0, help="log-std of the generation lengths")
    p.add_argument("--slots", type=int, help="sampler decode slots")
    p.add_argument("--group_size", type=int)
    p.add_argument("--batch_groups", type=int, help="groups (prompts) per update")
    p.add_argument("--max_concurrent", type=int, help="groups in flight when unbounded (default: 2 x slots / group)")
    p.add_argument("--micro_batch_tokens", type=int, help="trainer micro-batch tokens (default: the longest sequence)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--sampler_dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--moment_dtype", choices=("float32", "bfloat16"), default="float32",
                   help="train.moment_dtype: AdamW's moments in float32, or bfloat16 (stochastic rounding)")
    p.add_argument("--standby_rows", type=int, default=None,
                   help="the sampler's standby rows (default: the job's, num_slots / 2; 0 turns them off)")
    p.add_argument("--decode_attention", choices=("auto", "xla", "kernel"), default="auto",
                   help="rollout.decode_attention: the faster of the two, timed on GPUs (auto), XLA's (every cache "
                        "position on GPUs) or the ragged kernel")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="compute dtype (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--entropy", type=float, default=1.0,
                   help="mean next-token entropy (nats) the preset's random logits are tempered to, so a group's "
                        "samples differ and their rewards give non-zero advantages (ignored with --model)")
    p.add_argument("--temper_rows", type=int, default=32,
                   help="rows the model samples to temper its logits along (testing.models.temper_logits); 0 tempers "
                        "over random tokens only (minutes faster at the 0.5B shape on a CPU)")
    p.add_argument("--train_devices", type=int, help="mesh.train_devices (default: the job's split)")
    p.add_argument("--rollout_devices", type=int, help="mesh.rollout_devices")
    p.add_argument("--rollout_tensor", type=int, default=-1,
                   help="mesh.rollout_tensor: devices per sampler replica (-1: one sampler over every rollout device)")
    p.add_argument("--warmup_steps", type=int, default=3,
                   help="steps of the unmeasured runs that compile first: the least asynchronous eta of the list "
                        "runs max(--warmup_steps, --steps) steps (being synchronous, it replays the measured run's "
                        "packed shapes), the most asynchronous one --warmup_steps (0: no warm-up)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "loop"))
    p.add_argument("--device_memory_gib", type=float,
                   help="plan against this much memory per device (mesh.device_memory_gib) instead of what it reports")
    p.add_argument("--plan-only", dest="plan_only", action="store_true",
                   help="print the job's memory plan and whether it fits, then stop (nothing is allocated; on an "
                        "accelerator with a limit, the update's and the sampler's working memory are measured on "
                        "small programs too; on the CPU only the resident parts)")
    args = p.parse_args(argv)
    preset = loadgen.PRESETS[args.preset]
    for key in ("steps", "median", "cap", "slots", "group_size", "batch_groups"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    args.dtype = args.dtype or preset["dtype"]
    args.max_len = MAX_PROMPT_LEN + args.cap
    args.micro_batch_tokens = args.micro_batch_tokens or args.max_len
    args.max_concurrent = args.max_concurrent or max(1, 2 * args.slots // args.group_size)
    try:
        args.eta_list = [None if e.strip() in ("unbounded", "inf", "-1") else int(e) for e in args.etas.split(",")]
    except ValueError:
        p.error(f"--etas={args.etas!r}: give comma-separated integers >= 0 or 'unbounded', e.g. --etas=0,1,4,unbounded.")
    if any(e is not None and e < 0 for e in args.eta_list):
        p.error(f"--etas={args.etas!r}: each eta must be >= 0 or 'unbounded'.")
    if args.micro_batch_tokens < args.max_len:
        p.error(f"--micro_batch_tokens={args.micro_batch_tokens} is below the longest sequence ({args.max_len} = "
                f"{MAX_PROMPT_LEN} prompt + --cap {args.cap}); raise it or lower --cap.")
    if args.slots < args.group_size:
        p.error(f"--slots={args.slots} is smaller than --group_size={args.group_size}; a group must fit the slots.")
    if not 1 <= args.median <= args.cap:
        p.error(f"--median={args.median} must lie in [1, --cap={args.cap}].")
    if not args.entropy > 0:
        p.error(f"--entropy={args.entropy} must be > 0 nats (1.0 is the default).")
    return args


def prepare_assets(args: argparse.Namespace) -> tuple[str, str, str]:
    """(model dir, tokenizer dir, train jsonl): random preset weights are written once under OUT."""
    from areal_jax.data.math_tokenizer import build_math_tokenizer
    from areal_jax.data.synthetic_math import write_splits

    data = write_splits(os.path.join(args.out, "data"), 2000, 1, seed=args.seed)["train"]
    tok_dir = os.path.join(args.out, "tokenizer")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        build_math_tokenizer().save_pretrained(tok_dir)
    if args.model:
        has_tok = os.path.exists(os.path.join(args.model, "tokenizer.json"))
        return args.model, args.model if has_tok else tok_dir, data
    model_dir = os.path.join(args.out, f"model_{args.preset}_entropy{args.entropy:g}_rows{args.temper_rows}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        from areal_jax.testing.models import write_random_hf_checkpoint

        print(f"writing random {args.preset} weights to {model_dir} ...", flush=True)
        cfg = loadgen.model_config(args.preset, args.max_len, "float32")
        write_random_hf_checkpoint(model_dir, cfg, seed=args.seed, max_shard_size=2 * 1024**3, entropy=args.entropy,
                                   temper_rows=args.temper_rows)
    return model_dir, tok_dir, data


def job_config(args: argparse.Namespace, eta: int | None, steps: int, paths: tuple[str, str, str], run_dir: str):
    from areal_jax.config import base_config

    model_dir, tok_dir, data = paths
    c = base_config()
    c.run_dir, c.seed, c.total_steps = run_dir, args.seed, steps
    c.model.path, c.model.tokenizer_path = model_dir, tok_dir
    c.model.dtype, c.model.param_dtype = args.dtype, "float32"
    c.data.train_path, c.data.max_prompt_len = data, MAX_PROMPT_LEN
    c.rollout.group_size, c.rollout.max_new_tokens = args.group_size, args.cap
    c.rollout.max_len, c.rollout.num_slots = args.max_len, args.slots
    c.rollout.max_staleness = -1 if eta is None else eta
    c.rollout.max_concurrent = args.max_concurrent if eta is None else None
    c.rollout.param_dtype = args.sampler_dtype
    c.rollout.standby_rows, c.rollout.decode_attention = args.standby_rows, args.decode_attention
    c.train.batch_groups, c.train.lr, c.train.moment_dtype = args.batch_groups, args.lr, args.moment_dtype
    c.mesh.train_devices, c.mesh.rollout_devices = args.train_devices, args.rollout_devices
    c.mesh.rollout_tensor = args.rollout_tensor
    c.train.micro_batch_tokens = args.micro_batch_tokens
    c.reward.fn, c.reward.num_workers = "areal_jax.system.loadgen:bernoulli_reward", 1
    c.eval.n_test, c.eval.at_start, c.eval.at_end = 0, False, False
    c.checkpoint.every_steps, c.checkpoint.resume = 0, False
    c.log.console, c.log.tensorboard = False, False
    return c


def device_memory() -> dict | None:
    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def measure_handoff(job) -> dict:
    """The ParamChannel's reshard of the trainer's params vs a raw copy of the same bytes, same run (with sampler
    replicas: a copy to each replica's first device, as the hand-off writes a whole copy on each), and the job's
    own hand-off of the copy its trainer keeps."""
    from areal_jax.system.params import tree_nbytes

    params = job.trainer.params
    handoff = best_seconds(lambda: job.channel.reshard(params))
    dst = [m.devices.flat[0] for m in job.meshes.replica_meshes]
    moved, source = job.channel.last_bytes, tree_nbytes(params)  # moved: every replica's copy
    src = next(iter(jax.tree.leaves(params)[0].sharding.device_set))
    raw = raw_copy_seconds(moved // len(dst), src, dst)
    raw_source = raw_copy_seconds(source, src, dst) if source * len(dst) != moved else raw
    # What the job does since the trainer writes the sampler's copy in its update (trainer.publish): hand that
    # copy over, copied only where the layouts differ (the write is inside the update's time; the job's publish
    # time is the table's "publish ms").
    from areal_jax.system.parts import rollout_source

    job.channel.reshard(**rollout_source(job.trainer, job.channel))
    return {"job_handoff_copied": job.channel.last_copied,
            "handoff_s": handoff, "bytes_moved": moved, "source_bytes": source, "raw_copy_s": raw,
            "raw_copy_source_bytes_s": raw_source, "ratio_vs_raw_copy": handoff / raw,
            "ratio_vs_raw_copy_source_bytes": handoff / raw_source, "colocated": dst == [src],
            "handoff_GBps": moved / handoff / 1e9}


def staleness_of(run_dir: str, eta: int | None) -> dict:
    rows = [json.loads(ln) for ln in open(os.path.join(run_dir, "samples.jsonl")) if ln.strip()]
    stale = np.array([r["trained_version"] - r["min_token_version"] for r in rows])
    admit = np.array([r["trained_version"] - r["admit_version"] for r in rows])
    return {"staleness_mean": float(stale.mean()), "staleness_max": int(stale.max()),
            "staleness_hist": {int(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))},
            "admit_lag_max": int(admit.max()), "groups_trained": len(rows),
            "within_bound": bool(eta is None or stale.max() <= eta)}


def learning_of(rows: list[dict]) -> dict:
    """Whether the updates really changed the weights: the trained tokens' mean entropy, the share of groups whose
    samples all scored alike (they give zero advantages) and the mean gradient norm, over the job's metrics rows."""
    mean = lambda key: float(np.mean([r[key] for r in rows if key in r])) if any(key in r for r in rows) else None  # noqa: E731
    return {"entropy_mean": mean("train/entropy"), "uniform_group_fraction": mean("uniform_group_fraction"),
            "grad_norm_mean": mean("train/grad_norm")}


def rate_after_first(rows: list[dict]) -> float | None:
    """Trained tokens/s from the end of the first update to the end of the last, from the job's metrics rows (each has
    the loop's elapsed time and its cumulative trained tokens/s). Every eta's first batch waits for the same long tail
    (nothing was generated ahead), and a run of a few updates ends with work generated for versions it never trains:
    this is the rate a long run sees. None with fewer than two updates."""
    done = [(r["time/elapsed_s"], r["trained_tokens_per_s"] * r["time/elapsed_s"]) for r in rows if "time/elapsed_s" in r]
    if len(done) < 2 or done[-1][0] <= done[0][0]:
        return None
    return (done[-1][1] - done[0][1]) / (done[-1][0] - done[0][0])


def run_eta(args, eta: int | None, steps: int, paths, run_dir: str, measure: bool) -> dict:
    from areal_jax.system.job import RLJob

    lengths = loadgen.long_tail_lengths(4096, args.median, args.cap, sigma=args.sigma, seed=args.seed)
    # A run directory of an earlier invocation would add its metrics and samples to this run's (the job appends).
    shutil.rmtree(run_dir, ignore_errors=True)
    job = RLJob(job_config(args, eta, steps, paths, run_dir), log_fn=lambda *a, **k: None)
    try:
        job.controller.sampler = loadgen.ForcedLengths(job.sampler, lengths)
        job.controller.decode = loadgen.ids_as_text
        job.save_checkpoint = lambda: None  # the loop is measured, not checkpoint writes
        mem_built = device_memory()
        compile_before = dict(_COMPILE)
        summary = job.run()
        compile_s = _COMPILE["s"] - compile_before["s"]
        backend_compiles = _COMPILE["backend_compiles"] - compile_before["backend_compiles"]
        stats = job.sampler.stats()
        handoff = measure_handoff(job) if measure else None
        from areal_jax.trainer.memory import resident_bytes

        actual = {"params": resident_bytes(job.trainer.state.params),  # per device, like the plan
                  "optimizer": resident_bytes(job.trainer.state.opt_state),
                  "sampler_params": resident_bytes(job.sampler.versioned_params()[1])}
        mem_end = device_memory()
    finally:
        job.close()
    rows = [json.loads(ln) for ln in open(os.path.join(run_dir, "metrics.jsonl")) if ln.strip()]
    wall = summary["wall_s"]
    timeline = os.path.join(run_dir, "timeline.json")
    lat = loadgen.handoff_latencies(timeline)
    busy = loadgen.lane_busy_seconds(timeline)
    publish = [r["time/step_s"] - r["time/wait_batch_s"] for r in rows if "time/step_s" in r]
    after_first = rate_after_first(rows)
    out = {
        "eta": "unbounded" if eta is None else eta, "steps": summary["steps"], "wall_s": wall,
        "trained_tokens_per_s": summary["trained_tokens_per_s"], "trained_tokens_per_s_after_first": after_first,
        "completion_tokens_trained": float(sum(r.get("completion_tokens", 0) for r in rows)),
        "generated_tokens_per_s": stats["generated_tokens"] / wall, "generated_tokens": stats["generated_tokens"],
        "slot_occupancy": stats["mean_slot_occupancy"], "sampler_replicas": int(stats.get("replicas", 1)),
        "trainer_wait_share": float(sum(r["time/wait_batch_s"] for r in rows)) / wall,
        "decode_busy_share": busy.get("sampler", {}).get("decode_step", 0.0) / wall,
        "train_busy_share": busy.get("trainer", {}).get("train_step", 0.0) / wall,
        "recomputes": stats["recomputes"], "sampler_compiles": stats["compile_count"],
        "compile_s": compile_s, "compile_share": compile_s / wall, "backend_compiles": backend_compiles,
        **staleness_of(run_dir, eta), **learning_of(rows),
        "publish_s_mean": busy.get("trainer", {}).get("publish", 0.0) / max(1, summary["steps"]),
        "handoff_first_token_s_mean": float(np.mean([x["first_token_s"] for x in lat])) if lat else None,
        "handoff_first_token_s_max": float(np.max([x["first_token_s"] for x in lat])) if lat else None,
        "handoff_apply_s_mean": float(np.mean([x["apply_s"] for x in lat])) if lat else None,
        "update_step_s_mean": float(np.mean(publish)) if publish else None,
        "memory_built": mem_built, "memory_end": mem_end, "memory_actual": actual,
        "lane_busy_s": busy, "timeline": timeline,
    }
    if handoff is not None:
        out["handoff"] = handoff
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from areal_jax.programs.rl import enable_compilation_cache

    if not jax.config.jax_compilation_cache_dir:  # keep a cache the caller (e.g. the tests) set up
        enable_compilation_cache(os.path.join(args.out, "xla-cache"))
    dev = jax.local_devices()[0]
    peak = matmul_peak_gflops()
    print(f"device: {dev.device_kind} x{jax.local_device_count()}; float32 matmul peak {peak:.0f} GFLOP/s", flush=True)
    if args.model:
        from areal_jax.models.config import ModelConfig

        cfg = ModelConfig.from_pretrained(args.model, dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32)
    else:
        cfg = loadgen.model_config(args.preset, args.max_len, args.dtype)
    plan_out = job_plan(args, cfg, job_config(args, 0, 1, ("", "", ""), ""), device_memory(), dev.device_kind)
    if args.plan_only:
        return plan_out
    memory, limit, parts, sides = (plan_out[k] for k in ("memory", "memory_limit_bytes", "memory_plan_bytes",
                                                          "memory_sides_bytes"))
    plan, n_params = memory.plan, memory.n_params
    paths = prepare_assets(args)
    if args.warmup_steps:
        # The least asynchronous eta replays its measured run's packed shapes (its batches do not depend on
        # timing); the most asynchronous one compiles the re-prefill after a weight update.
        least = min(e for e in args.eta_list if e is not None) if any(e is not None for e in args.eta_list) else None
        most = None if None in args.eta_list else max(args.eta_list)
        warm = [(least, max(args.warmup_steps, args.steps))] + ([(most, args.warmup_steps)] if most != least else [])
        for eta, steps in warm:
            name = "unbounded" if eta is None else eta
            print(f"warm-up (eta {name}, {steps} steps: compiles) ...", flush=True)
            run_eta(args, eta, steps, paths, os.path.join(args.out, f"warmup_eta{name}"), False)
    results = []
    for i, eta in enumerate(args.eta_list):
        name = "eta_unbounded" if eta is None else f"eta{eta}"
        print(f"running {name} ({args.steps} steps) ...", flush=True)
        try:
            results.append(run_eta(args, eta, args.steps, paths, os.path.join(args.out, name),
                                   measure=i == len(args.eta_list) - 1))
        except Exception as e:  # an allocation failure: say which part to shrink
            if "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e):
                from areal_jax.system.memory import HINTS

                big = max(plan.parts.items(), key=lambda kv: kv[1])[0]
                raise SystemExit(f"{name} ran out of device memory; the largest part is {big}: "
                                 f"{HINTS.get(big, '')}; training activations grow with "
                                 f"--micro_batch_tokens ({args.micro_batch_tokens}).") from e
            raise
    base = results[0]
    print(f"{'eta':>9} {'wall s':>7} {'train tok/s':>11} {'x eta0':>6} {'after 1st':>9} {'x eta0':>6} "
          f"{'gen tok/s':>9} {'x eta0':>6} "
          f"{'occup':>5} {'wait':>5} {'stale':>9} {'publish ms':>10} {'->token ms':>10} {'compile s':>9} {'entropy':>7} "
          f"{'alike':>5}")
    for r in results:
        r["trained_ratio_vs_first"] = r["trained_tokens_per_s"] / base["trained_tokens_per_s"]
        later = (r["trained_tokens_per_s_after_first"], base["trained_tokens_per_s_after_first"])
        r["trained_after_first_ratio_vs_first"] = later[0] / later[1] if None not in later else None
        r["generated_ratio_vs_first"] = r["generated_tokens_per_s"] / base["generated_tokens_per_s"]
        tok = r["handoff_first_token_s_mean"]
        fmt = lambda x, spec: "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)  # noqa: E731
        print(f"{r['eta']!s:>9} {r['wall_s']:>7.1f} {r['trained_tokens_per_s']:>11.0f} {r['trained_ratio_vs_first']:>6.2f} "
              f"{fmt(r['trained_tokens_per_s_after_first'], '9.0f')} {fmt(r['trained_after_first_ratio_vs_first'], '6.2f')} "
              f"{r['generated_tokens_per_s']:>9.0f} {r['generated_ratio_vs_first']:>6.2f} {r['slot_occupancy']:>5.2f} "
              f"{r['trainer_wait_share']:>5.2f} {r['staleness_mean']:>4.2f}/{r['staleness_max']:<4d} "
              f"{1e3 * r['publish_s_mean']:>10.1f} {'-' if tok is None else format(1e3 * tok, '>10.1f')} "
              f"{r['compile_s']:>9.1f} {fmt(r['entropy_mean'], '7.3f')} {fmt(r['uniform_group_fraction'], '5.2f')}")
    h = results[-1].get("handoff")
    if h:
        print(f"hand-off: {h['bytes_moved'] / 1e6:.1f} MB in {1e3 * h['handoff_s']:.2f} ms; raw copy of the same bytes "
              f"{1e3 * h['raw_copy_s']:.2f} ms (ratio {h['ratio_vs_raw_copy']:.2f}); raw copy of the float32 source "
              f"{1e3 * h['raw_copy_source_bytes_s']:.2f} ms (ratio {h['ratio_vs_raw_copy_source_bytes']:.2f}) "
              f"-- the channel's own copy of the float32 params")
        print(f"the job's own hand-off (publish ms above): the copy its trainer writes in the update, "
              f"{'copied to the rollout slice' if h['job_handoff_copied'] else 'handed over, no copy'}")
    report = {"benchmark": "loop", "preset": args.model or args.preset, "device": dev.device_kind,
              "n_devices": jax.local_device_count(), "matmul_peak_gflops": peak, "n_params": n_params,
              "memory_plan_bytes": parts, "memory_sides_bytes": sides, "memory_limit_bytes": limit,
              "settings": {k: getattr(args, k) for k in ("steps", "median", "cap", "sigma", "slots", "group_size",
                                                         "batch_groups", "max_concurrent", "micro_batch_tokens",
                                                         "lr", "sampler_dtype", "dtype", "seed", "entropy",
                                                         "decode_attention")},
              "results": results}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
