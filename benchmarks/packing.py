"""Packing of a minibatch into micro-steps: the share of computed positions that are real tokens, now against
the rule before, on the workloads of real runs; then Trainer.update timed under both rules on this machine.

The layout (`trainer.layout.step_layout`) gives every micro-step of a minibatch one shape [devices x rows, row
length]. The rule before took, for each row length, as many rows per device as one micro-step of the whole
minibatch needs (a power of two), capped at the budget, and counted positions only; so a minibatch a little
larger than one micro-step paid for a second one that was mostly padding. Now rows per device are any power of
two up to that (`row_counts`) and each micro-step costs a fixed `MICRO_STEP_OVERHEAD` positions as well. The rows
"cheapest" pack every minibatch in its cheapest layout; the rows "now" are the trainer's default, which takes a
shape not compiled yet only as its `layout.ShapeBook` decides (train.new_shape_cost, --new-shape-cost here), and
so trades some padding for fewer compiles.

    python benchmarks/packing.py                      # layouts of four workloads, then the timed update
    python benchmarks/packing.py --skip-time          # layouts only (seconds; no device involved)

Workloads (lengths drawn as the named run would make them; completions log-normal, sigma 1):
  issue      the trainer issue's update: 128 trajectories, prompts 64-128, completions median 256 (cap 1,024),
             1 device, micro_batch_tokens 16,384, one minibatch (benchmarks/trainer.py --preset qwen2.5-0.5b)
  gsm8k      configs/gsm8k_qwen.py on an 8-GPU host: 64 groups x 8, 4 minibatches, 4 train devices, budget
             16,384, chat prompts of 100-200 tokens, completions median 300 (cap 1,024), the 1.5B shape
  reasoning  512 trajectories, 4 minibatches, 8 train devices, budget 32,768, completions median 1,000 (cap
             8,192), the 1.5B shape
  default    configs/math.py: 16 groups x 8, 4 minibatches, 1 device, budget 2,048, prompts 29-37, completions
             median 24 (cap 48)
The timed part runs the gsm8k workload's minibatches (scaled to --time-budget tokens per device) through
Trainer.update with the benchmark model on 4 host devices, the rule before against the cheapest layouts, alternated,
and ends with ONE JSON line.
"""
from __future__ import annotations

from areal_jax.runtime.host_devices import use_host_devices

use_host_devices(4, keep_count=True)  # before jax is imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from areal_jax.trainer import batch as batch_mod  # noqa: E402
from areal_jax.trainer import layout  # noqa: E402
from areal_jax.trainer.config import TrainerConfig  # noqa: E402

QWEN_05B = dict(num_layers=24, num_heads=14, head_dim=64, params=494e6)
QWEN_15B = dict(num_layers=28, num_heads=12, head_dim=128, params=1.54e9)
WORKLOADS = {
    "issue": dict(n=128, minibatches=1, devices=1, budget=16384, prompt=(64, 128), median=256, cap=1024,
                  shape=QWEN_05B),
    "gsm8k": dict(n=512, minibatches=4, devices=4, budget=16384, prompt=(100, 200), median=300, cap=1024,
                  shape=QWEN_15B),
    "reasoning": dict(n=512, minibatches=4, devices=8, budget=32768, prompt=(100, 300), median=1000, cap=8192,
                      shape=QWEN_15B),
    "default": dict(n=128, minibatches=4, devices=1, budget=2048, prompt=(29, 37), median=24, cap=48,
                    shape=dict(num_layers=4, num_heads=4, head_dim=64, params=3.2e6)),
}


def previous_row_counts(total_tokens: int, row_len: int, n_devices: int, budget: int) -> list[int]:
    """The rule before: the power of two of rows per device one micro-step of the minibatch needs, capped at the
    budget."""
    needed = -(-(-(-max(total_tokens, 1) // row_len)) // n_devices)
    return [min(max(1, budget // row_len), 1 << (needed - 1).bit_length())]


def previous_layout(lengths, n_devices, budget, attention_weight=0.0, step_overhead=0, book=None):
    """The rule before: the cheapest layout in positions alone, whatever its shape."""
    return layout.step_layout(lengths, n_devices, budget, attention_weight, step_overhead=0)


@contextlib.contextmanager
def previous_rule():
    """Trainer.update and step_layout pack with the rule before while this is open."""
    counts, pack = layout.row_counts, batch_mod.step_layout
    layout.row_counts = previous_row_counts
    batch_mod.step_layout = previous_layout
    try:
        yield
    finally:
        layout.row_counts, batch_mod.step_layout = counts, pack


def draw(w: dict, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One update's prompt and completion lengths."""
    p = rng.integers(w["prompt"][0], w["prompt"][1] + 1, w["n"])
    c = np.clip(np.ceil(np.exp(rng.normal(np.log(w["median"]), 1.0, w["n"]))), 2, w["cap"]).astype(int)
    return p, c


def lengths_of(w: dict, rng: np.random.Generator) -> list[list[int]]:
    """One update's minibatches of packed lengths (prompt + completion - 1), shuffled into minibatches."""
    p, c = draw(w, rng)
    lengths = (p + c - 1).tolist()
    return [[lengths[i] for i in part] for part in np.array_split(rng.permutation(w["n"]), w["minibatches"])]


def layout_figures(w: dict, updates: int, seed: int, new_shape_cost: float) -> dict:
    """Per rule: real share of the computed positions, micro-steps per minibatch, distinct shapes, host ms. The
    rules: previous; cheapest (now, every minibatch in its cheapest layout); now (the trainer's default: new
    shapes through a `layout.ShapeBook` of `new_shape_cost`)."""
    s = w["shape"]
    weight = s["num_layers"] * s["num_heads"] * s["head_dim"] / s["params"]
    out = {}
    for rule in ("previous", "cheapest", "now"):
        rng = np.random.default_rng(seed)
        book = layout.ShapeBook(new_shape_cost if rule == "now" else 0.0)
        real = positions = steps = calls = 0
        shapes, seconds = set(), 0.0
        with previous_rule() if rule == "previous" else contextlib.nullcontext():
            for _ in range(updates):
                for lengths in lengths_of(w, rng):
                    t = time.perf_counter()
                    row_len, per_device, rows = batch_mod.step_layout(lengths, w["devices"], w["budget"], weight,
                                                                      layout.MICRO_STEP_OVERHEAD, book)
                    seconds += time.perf_counter() - t
                    n = len(rows) // (w["devices"] * per_device)
                    real, positions = real + sum(lengths), positions + len(rows) * row_len
                    steps, calls = steps + n, calls + 1
                    shapes.add((row_len, per_device))
        out[rule] = dict(real_share=real / positions, micro_steps=steps / calls, shapes=len(shapes),
                         host_ms=1e3 * seconds / calls, positions=positions)
    return out


def timed_updates(args) -> dict:
    """Trainer.update on the gsm8k workload (lengths scaled to --time-budget), the rules alternated."""
    import jax
    from common import add_model_args, device_peak_gflops, model_config
    from jax.sharding import Mesh

    from areal_jax.testing import models as testing
    from areal_jax.trainer import Trainer, Trajectory

    model_args = add_model_args(argparse.ArgumentParser()).parse_args([])
    cfg = model_config(model_args)
    w = dict(WORKLOADS["gsm8k"])
    scale = args.time_budget / w["budget"]
    w.update(budget=args.time_budget, prompt=tuple(max(2, int(x * scale)) for x in w["prompt"]),
             median=max(2, int(w["median"] * scale)), cap=max(4, int(w["cap"] * scale)))
    rng = np.random.default_rng(args.seed)
    trajs = [Trajectory(tokens=rng.integers(3, cfg.vocab_size, p + c), prompt_len=p,
                        behav_logp=rng.normal(-np.log(cfg.vocab_size), 0.1, c).astype(np.float32),
                        versions=np.zeros(c, np.int32), advantage=float(rng.normal()))
             for p, c in zip(*(x.tolist() for x in draw(w, rng)))]
    devices = jax.devices()[: w["devices"]]
    mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tensor"))
    # new_shape_cost=0: every update packs each minibatch in its cheapest layout (the rules compared), compiled in
    # the warm-up.
    tcfg = TrainerConfig(lr=1e-5, micro_batch_tokens=w["budget"], logits_chunk=256, ppo_minibatches=w["minibatches"],
                         prox_mode="loglinear", new_shape_cost=0.0)
    trainers = {}
    for rule in ("previous", "now"):
        with previous_rule() if rule == "previous" else contextlib.nullcontext():
            trainers[rule] = Trainer(testing.random_model(cfg, seed=0), tcfg, mesh)
            trainers[rule].update(trajs)  # compile
    times = {k: [] for k in trainers}
    peak = 0.0
    for _ in range(args.repeats):
        peak = max(peak, device_peak_gflops("float32", repeats=2))
        for rule, trainer in trainers.items():
            with previous_rule() if rule == "previous" else contextlib.nullcontext():
                t = time.perf_counter()
                trainer.update(trajs)
                times[rule].append(time.perf_counter() - t)
    tokens = sum(t.packed_len for t in trajs)
    return dict(device=f"{len(devices)} x {jax.devices()[0].device_kind}", matmul_peak_gflops=peak, tokens=tokens,
                budget=w["budget"], **{f"{k}_tokens_per_s": tokens / statistics.median(v) for k, v in times.items()})


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=20, help="updates drawn per workload for the layout figures")
    p.add_argument("--skip-time", action="store_true", help="layouts only")
    p.add_argument("--time-budget", type=int, default=2048, help="micro_batch_tokens of the timed update")
    p.add_argument("--repeats", type=int, default=2, help="timed updates per rule (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-shape-cost", type=float, default=TrainerConfig.new_shape_cost,
                   help="the ShapeBook's cost of a new shape in micro-steps (train.new_shape_cost)")
    p.add_argument("--compile-micro-steps", type=float, default=10.3,
                   help="what one compile costs in micro-steps' time, for the totals with compiles (default: "
                        "benchmarks/trainer.py at the default job's shape on the 2-core CPU)")
    args = p.parse_args(argv)
    result = {"layouts": {}}
    print(f"{'workload':10s} {'rule':9s} {'real share':>10s} {'micro-steps':>11s} {'shapes':>6s} {'host ms':>8s}")
    for name, w in WORKLOADS.items():
        figs = layout_figures(w, args.updates, args.seed, args.new_shape_cost)
        for rule, f in figs.items():
            print(f"{name:10s} {rule:9s} {f['real_share']:10.1%} {f['micro_steps']:11.2f} {f['shapes']:6d} "
                  f"{f['host_ms']:8.1f}")
        ratio = figs["previous"]["positions"] / figs["now"]["positions"]
        # Compiles in positions: a micro-step is `budget` positions on each device, all devices at once.
        compile_positions = args.compile_micro_steps * w["budget"] * w["devices"]
        for f in figs.values():
            f["with_compiles"] = f["positions"] + f["shapes"] * compile_positions
        print(f"{'':10s} computed positions previous / now: {ratio:.3f}x; now / cheapest: "
              f"{figs['now']['positions'] / figs['cheapest']['positions']:.3f}x; with a compile costing "
              f"{args.compile_micro_steps:g} micro-steps, now / cheapest: "
              f"{figs['now']['with_compiles'] / figs['cheapest']['with_compiles']:.3f}x")
        result["layouts"][name] = {**figs, "positions_ratio": ratio}
    if not args.skip_time:
        t = timed_updates(args)
        ratio = t["now_tokens_per_s"] / t["previous_tokens_per_s"]
        print(f"\nTrainer.update, gsm8k workload at micro_batch_tokens {t['budget']} ({t['tokens']:,} tokens), "
              f"{t['device']}, float32 matmul peak {t['matmul_peak_gflops']:.0f} GFLOP/s:")
        print(f"  previous rule {t['previous_tokens_per_s']:,.0f} tokens/s, now {t['now_tokens_per_s']:,.0f} "
              f"tokens/s: {ratio:.2f}x")
        result["timed"] = {**t, "ratio": ratio}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
