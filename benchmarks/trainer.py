"""PPO update throughput: areal_jax Trainer against an equivalent HF transformers + PyTorch step, same device.

One run, same weights and the same batch of trajectories for both:
  (a) Trainer.update with prox_mode="loglinear" (no extra forward: the same work as a training step);
  (b) Trainer.update with prox_mode="recompute" (one extra forward pass for the proximal log-probs);
  (c) HF transformers (PyTorch, same checkpoint, on the device JAX runs on: CUDA when JAX is on a GPU,
      left out when PyTorch cannot reach that device): per micro-batch of padded rows (sorted by length
      to limit padding) forward (under torch.autocast(bfloat16) when --dtype bfloat16; float32
      params either way, like ours), the same clipped objective with a float32 log-softmax, backward;
      then clip the gradient norm and one torch.optim.AdamW step (per minibatch with --minibatches).
On the CPU the engines run round-robin (a, b, c, a, b, c, ...) after one warm-up each, so they share the
machine's load; on an accelerator one after another, each freed before the next (so each engine's peak
device memory is its own). Each reports its median. Prints tokens/s (trained tokens: prompt + completion),
model FLOP utilisation against this machine's matmul peak in the compute dtype (a jitted n^3 matmul,
n = 2048 on CPU, 8192 on accelerators, best of several measurements in the same run), peak device memory
per engine (JAX memory_stats / torch.cuda.max_memory_allocated; on the CPU the process's peak RSS, which
covers every engine), the ratio a/c, and ends with ONE line of JSON. Model FLOPs of a training step: 3 *
forward FLOPs, forward = 2 * (matmul params) per token + attention over the real causal context of each
sequence (4 * layers * heads * head_dim * ctx); (b) adds one forward. Rematerialisation's recomputation
is not counted (model FLOPs, not hardware FLOPs).

    python benchmarks/trainer.py                 # default tiny model, a few minutes on 2 CPU cores
    python benchmarks/trainer.py --hidden 512 --layers 8 --skip-hf
    python benchmarks/trainer.py --preset qwen2.5-0.5b --dtype bfloat16     # one GPU: the issue's workload
    python benchmarks/trainer.py --preset qwen2.5-0.5b --micro-batch-tokens 65536 --remat full --skip-hf
    python benchmarks/trainer.py --preset qwen2.5-0.5b --trajectory-len 32768 --remat full --skip-hf
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave device memory to PyTorch's engine too
# the PyTorch baseline as its users run it at this size: without expandable segments its caching allocator
# fragments and the 0.5B step at 16,384-token micro-batches runs out of memory on an 80 GB GPU
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import add_model_args, device_peak_gflops, model_config, toy_fields  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from torch_baseline import hf_step, torch_device  # noqa: E402

from areal_jax.models import load_hf_checkpoint  # noqa: E402
from areal_jax.models.config import ModelConfig  # noqa: E402
from areal_jax.system.loadgen import MODEL_SHAPES, shape_config  # noqa: E402
from areal_jax.testing import models as testing  # noqa: E402
from areal_jax.trainer import Trainer, TrainerConfig, Trajectory  # noqa: E402
from areal_jax.trainer.batch import split_minibatches  # noqa: E402

# The model shapes of areal_jax.system.loadgen.MODEL_SHAPES and the workload of the trainer issue for each:
# trajectories, prompt lengths, completion median / cap (log-normal, sigma 1), micro_batch_tokens, logits_chunk.
_SMALL = dict(num_seqs=128, prompt_len=(64, 128), median_completion=256, max_completion=1024, micro_batch_tokens=16384,
              logits_chunk=4096)
_MEDIUM = dict(_SMALL, num_seqs=64)
_LARGE = dict(num_seqs=32, prompt_len=(64, 128), median_completion=256, max_completion=1024, micro_batch_tokens=8192,
              logits_chunk=2048)
PRESETS = {"qwen2.5-0.5b": dict(workload=_SMALL), "qwen2.5-1.5b": dict(workload=_MEDIUM),
           "qwen2.5-7b": dict(workload=_LARGE), "gemma3-1b": dict(workload=_SMALL), "gemma3-4b": dict(workload=_MEDIUM),
           "phi4-mini": dict(workload=_MEDIUM), "granite3-moe-1b": dict(workload=_SMALL)}
TINY_WORKLOAD = dict(num_seqs=64, prompt_len=(16, 64), median_completion=64, max_completion=256,
                     micro_batch_tokens=1024, logits_chunk=256)
TOY_WORKLOAD = dict(num_seqs=8, prompt_len=(8, 16), median_completion=16, max_completion=48,
                    micro_batch_tokens=256, logits_chunk=64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["tiny", *PRESETS], default="tiny",
                   help="model shape and workload; tiny is sized by the model flags below")
    add_model_args(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="compute dtype; params and optimizer state stay float32 (default: float32 for tiny, "
                        "bfloat16 for the Qwen presets)")
    p.add_argument("--remat", choices=("none", "full", "dots"), default="none", help="TrainerConfig.remat")
    p.add_argument("--scan-layers", action="store_true", help="TrainerConfig.scan_layers: the layers as one scan")
    p.add_argument("--attention", choices=("auto", "dense", "blocked", "flash"), default="auto",
                   help="TrainerConfig.attention")
    p.add_argument("--num-seqs", type=int, help="trajectories per update")
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--median-completion", type=int)
    p.add_argument("--max-completion", type=int)
    p.add_argument("--trajectory-len", type=int, help="instead: ONE trajectory of this many tokens (64-token prompt)")
    p.add_argument("--micro-batch-tokens", type=int)
    p.add_argument("--logits-chunk", type=int)
    p.add_argument("--minibatches", type=int, default=1,
                   help="optimizer steps per update (TrainerConfig.ppo_minibatches; the PyTorch step takes the same "
                        "minibatches); the default job uses 4")
    p.add_argument("--repeats", type=int, default=3, help="timed updates per engine (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="leave out (c)")
    p.add_argument("--skip-recompute", action="store_true", help="leave out (b)")
    p.add_argument("--skip-jax", action="store_true",
                   help="leave out (a) and (b): the PyTorch step alone, e.g. in its own process on a GPU")
    p.add_argument("--profile", metavar="DIR", help="write a jax.profiler trace of one update of (a) to DIR")
    p.add_argument("--toy", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sequential", action="store_true", help=argparse.SUPPRESS)  # the accelerator order on CPU
    args = p.parse_args(argv)
    workload = TINY_WORKLOAD if args.preset == "tiny" else PRESETS[args.preset]["workload"]
    if args.toy:
        workload = TOY_WORKLOAD
    for key, value in workload.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "float32" if args.preset == "tiny" else "bfloat16"
    if args.trajectory_len is not None and args.trajectory_len > args.micro_batch_tokens:
        p.error(f"--trajectory-len {args.trajectory_len} does not fit --micro-batch-tokens "
                f"{args.micro_batch_tokens}: a trajectory must fit one micro-batch; raise --micro-batch-tokens.")
    return args


def bench_model_config(args: argparse.Namespace) -> ModelConfig:
    """The benchmark model: tiny from the model flags, else the preset's shape (toy-sized with --toy)."""
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    if args.preset == "tiny":
        return model_config(args, dtype=dtype)
    fields = toy_fields(MODEL_SHAPES[args.preset], layers=2) if args.toy else {}
    max_len = max(4096, args.trajectory_len or 0, args.prompt_len[1] + args.max_completion)
    return shape_config(args.preset, max_len=max_len, dtype=jnp.dtype(dtype).name, param_dtype="float32", **fields)


def make_batch(args: argparse.Namespace, vocab: int) -> list[Trajectory]:
    """Trajectories with long-tailed completion lengths (clipped log-normal, sigma 1) and GRPO-like
    advantages; behaviour log-probs near uniform so importance weights stay moderate. With
    --trajectory-len: one trajectory of that many tokens (64 of them prompt)."""
    rng = np.random.default_rng(args.seed)
    if args.trajectory_len is not None:
        shapes = [(min(64, args.trajectory_len // 2), args.trajectory_len - min(64, args.trajectory_len // 2))]
    else:
        shapes = []
        for _ in range(args.num_seqs):
            p = int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1))
            c = int(np.clip(np.ceil(np.exp(rng.normal(np.log(args.median_completion), 1.0))), 2,
                            args.max_completion))
            shapes.append((p, c))
    return [Trajectory(tokens=rng.integers(3, vocab, p + c), prompt_len=p,
                       behav_logp=rng.normal(-np.log(vocab), 0.1, c).astype(np.float32),
                       versions=np.zeros(c, np.int32), advantage=float(rng.normal())) for p, c in shapes]


def forward_flops(cfg, trajs: list[Trajectory]) -> float:
    """Forward model FLOPs of the packed inputs (L - 1 tokens per trajectory, real causal context)."""
    d, hq, hd, layers = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_layers
    dense = 2 * (cfg.matmul_params_per_token + d * cfg.vocab_size)  # a mixture of experts: its active weights
    total = 0.0
    for t in trajs:
        n = t.packed_len
        total += n * dense + 4.0 * layers * hq * hd * (n * (n + 1) / 2)
    return total


FIRST_UPDATE_S: dict[str, float] = {}  # prox_mode -> seconds of the warm-up update
FIRST_UPDATE_METRICS: dict[str, dict] = {}  # prox_mode -> what the warm-up update returned


def trainer_step(model, cfg: TrainerConfig, trajs):
    """A warmed-up (compiled) callable running one Trainer.update on one device, and the trainer."""
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    trainer = Trainer(model, cfg, mesh)
    start = time.perf_counter()
    FIRST_UPDATE_METRICS[cfg.prox_mode] = trainer.update(trajs)  # compile
    FIRST_UPDATE_S[cfg.prox_mode] = time.perf_counter() - start  # tracing + compiling (cold or cached) + one update
    return (lambda: trainer.update(trajs)), trainer  # update returns host floats: the step has finished


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def jax_peak_bytes() -> int | None:
    """Peak bytes in use on JAX's first device since the process started (None where not reported)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_engines(engines: dict, repeats: int, on_cpu: bool, dtype: str, peak: float) -> tuple[dict, dict, float]:
    """Time each engine `repeats` times (after its warm-up, done by its builder). engines: name ->
    builder returning (step, cleanup). Returns (seconds per name, peak memory bytes per name, peak)."""
    times, memory = {k: [] for k in engines}, {}
    if on_cpu:  # round-robin so every engine (and the peak) sees the same machine load
        built = {k: build() for k, build in engines.items()}
        for _ in range(repeats):
            peak = max(peak, device_peak_gflops(dtype, repeats=2))
            for k, (fn, _) in built.items():
                times[k].append(timed(fn))
        for _, cleanup in built.values():
            cleanup()
        memory = {k: None for k in engines}
        return times, memory, peak
    for k, build in engines.items():  # one after another, each freed before the next
        step, cleanup = build()
        times[k] = [timed(step) for _ in range(repeats)]
        memory[k] = cleanup()
        gc.collect()
    return times, memory, peak


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = bench_model_config(args)
    trajs = make_batch(args, cfg.vocab_size)
    tokens = sum(t.packed_len for t in trajs)
    fwd = forward_flops(cfg, trajs)
    platform = jax.default_backend()
    on_cpu = platform == "cpu" and not args.sequential
    peak = device_peak_gflops(args.dtype)
    base = TrainerConfig(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens, logits_chunk=args.logits_chunk,
                         remat=args.remat, attention=args.attention, ppo_minibatches=args.minibatches,
                         scan_layers=args.scan_layers)
    hf_device, hf_note = None, None
    if not args.skip_hf:
        try:
            hf_device = torch_device()
        except ImportError:
            hf_note = "torch is not installed"
        if hf_device is None and hf_note is None:
            hf_note = f"PyTorch cannot reach JAX's {platform} device; no cross-device comparison is made"
    with tempfile.TemporaryDirectory() as path:
        if hf_device is not None:
            testing.write_random_hf_checkpoint(path, cfg, seed=args.seed)
            model = load_hf_checkpoint(path, param_dtype=jnp.float32, dtype=cfg.dtype)
        else:
            model = testing.random_model(cfg, seed=args.seed)
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        print(f"model: {args.preset}{' (toy size)' if args.toy else ''}, {n_params / 1e6:.2f}M params, "
              f"d={cfg.hidden_size}, layers={cfg.num_layers}, vocab={cfg.vocab_size}, {args.dtype} compute, float32 "
              f"params; {len(trajs)} trajectories, {tokens} trained tokens (completion median "
              f"{int(np.median([t.completion_len for t in trajs]))}, max {max(t.completion_len for t in trajs)}); "
              f"micro_batch_tokens={args.micro_batch_tokens}, remat={args.remat}, attention={args.attention}, "
              f"scan_layers={args.scan_layers}; jax "
              f"{jax.__version__} on {jax.devices()[0].device_kind}, {os.cpu_count()} cores", flush=True)

        def jax_engine(prox_mode):
            def build():
                step, trainer = trainer_step(model, base.replace(prox_mode=prox_mode), trajs)

                def cleanup():
                    used = jax_peak_bytes()
                    if args.profile and prox_mode == "loglinear":
                        # After the timed updates (a profiler failure cannot cost the timing) and after the
                        # warm-up (no compilation in the trace).
                        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
                            step()
                    trainer.state = None
                    return used
                return step, cleanup
            return build

        def hf_engine():
            step = hf_step(path, trajs, args.micro_batch_tokens, args.seed, args.dtype, hf_device,
                           minibatches=split_minibatches(trajs, args.minibatches))

            def cleanup():
                import torch

                used = torch.cuda.max_memory_allocated() if hf_device == "cuda" else None
                nonlocal step
                step = None
                if hf_device == "cuda":
                    torch.cuda.empty_cache()
                return used
            return step, cleanup

        engines = {} if args.skip_jax else {"a": jax_engine("loglinear")}
        if not args.skip_recompute and not args.skip_jax:
            engines["b"] = jax_engine("recompute")
        if hf_device is not None:
            engines["c"] = hf_engine
        times, memory, peak = run_engines(engines, args.repeats, on_cpu, args.dtype, peak)
        medians = {k: statistics.median(v) for k, v in times.items()}

    print(f"matmul peak: {peak:.1f} GFLOP/s ({args.dtype}, jitted, best of the run)")
    if hf_note:
        print(f"(c) left out: {hf_note}")

    def row(name: str, key: str, flops: float) -> dict:
        seconds = medians.get(key)
        if seconds is None:
            print(f"  {name:<44} skipped")
            return {"tokens_per_s": None, "seconds": None, "mfu": None, "tflops": None}
        tps, mfu = tokens / seconds, flops / seconds / (peak * 1e9)
        mem = memory.get(key)
        mem_text = f"  peak memory {mem / 2**30:6.2f} GiB" if mem is not None else ""
        print(f"  {name:<44} {seconds:7.3f} s  {tps:9.1f} tok/s  MFU {100 * mfu:5.1f}%{mem_text}")
        return {"tokens_per_s": round(tps, 1), "seconds": round(seconds, 4), "mfu": round(mfu, 4),
                "tflops": float(f"{flops / seconds / 1e12:.4g}")}

    res = {
        "jax_loglinear": row("(a) areal_jax update, prox loglinear", "a", 3 * fwd),
        "jax_recompute": row("(b) areal_jax update, prox recompute", "b", 4 * fwd),
        "hf_torch": row(f"(c) HF transformers + PyTorch ({hf_device or '-'})", "c", 3 * fwd),
    }
    ratio = medians["c"] / medians["a"] if "c" in medians and "a" in medians else None
    if ratio is not None:
        print(f"speed-up a/c: {ratio:.2f}x")
    for mode, seconds in FIRST_UPDATE_S.items():
        print(f"first update (prox {mode}; tracing and compiling included): {seconds:.1f} s")
    # What one compile of the update's programs costs in micro-steps of this workload: the train.new_shape_cost
    # (trainer.layout.ShapeBook) this device and model call for.
    packing, compile_steps = FIRST_UPDATE_METRICS.get("loglinear", {}), None
    if packing and "a" in medians:
        per_step = medians["a"] / packing["micro_steps"]
        compile_steps = max(FIRST_UPDATE_S["loglinear"] - medians["a"], 0.0) / per_step
        print(f"packing: {int(packing['micro_steps'])} micro-steps, {packing['packed_fraction']:.1%} of positions "
              f"real; one compile ~ {compile_steps:.1f} micro-steps' time (train.new_shape_cost)")
    rss = rss_peak_bytes()
    if platform == "cpu":
        print(f"peak memory: n/a per engine on the CPU; process peak RSS {rss / 2**30:.2f} GiB (all engines)")
    names = {"a": "jax_loglinear", "b": "jax_recompute", "c": "hf_torch"}
    report = {
        "benchmark": "trainer", "params": int(n_params), "tokens": tokens, "peak_gflops": round(peak, 1),
        "micro_batch_tokens": args.micro_batch_tokens, "minibatches": args.minibatches,
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in res.items()},
        "mfu": {k: v["mfu"] for k, v in res.items()},
        "speedup_vs_hf": None if ratio is None else round(ratio, 3),
        "preset": args.preset, "toy": args.toy, "dtype": args.dtype, "remat": args.remat,
        "attention": args.attention, "device": jax.devices()[0].device_kind, "platform": platform,
        "hf_device": hf_device, "hf_note": hf_note, "trajectories": len(trajs),
        "torch_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if hf_device == "cuda" else None,
        "tflops": {k: v["tflops"] for k, v in res.items()},
        "peak_memory_bytes": {names[k]: memory.get(k) for k in names},
        "process_peak_rss_bytes": rss, "scan_layers": args.scan_layers,
        "first_update_s": {("jax_" + k): round(v, 2) for k, v in FIRST_UPDATE_S.items()},
        "micro_steps": packing.get("micro_steps"), "packed_fraction": packing.get("packed_fraction"),
        "compile_in_micro_steps": None if compile_steps is None else round(compile_steps, 2),
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
