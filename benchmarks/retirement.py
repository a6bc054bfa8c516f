"""Task retirement (rollout.retire_solved / retire_unsolved) against none, on a run that passes over its data
several times.

    python benchmarks/retirement.py [--tasks 128] [--steps 40] [--seeds 0] [--solved 2] [--unsolved 0]

Each run is the default math job (configs/math.py, its own process, a fresh compile cache unless
--compile-cache shared) on the
first --tasks rows of its training set, so --steps updates of 16 groups pass over them steps * 16 / tasks times.
Printed side by side, per seed and as a mean: the share of trained groups whose samples all scored alike (zero
group advantage: generation that teaches nothing), the groups with an advantage per minute of the training loop,
the generated tokens, the loop's wall time, the train accuracy of the last quarter, the test greedy pass@1 at the
end, and how many tasks were retired and prompts skipped. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import numpy as np
from common import run_main_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "math.py")
TRAIN = os.path.join(ROOT, "assets", "math_reasoner", "data", "train.jsonl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=128, help="training rows kept (the first ones of the default set)")
    p.add_argument("--steps", type=int, default=40, help="updates per run (16 groups each)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--solved", type=int, default=2, help="rollout.retire_solved of the retiring runs")
    p.add_argument("--unsolved", type=int, default=0, help="rollout.retire_unsolved of the retiring runs")
    p.add_argument("--n-test", type=int, default=500, help="eval.n_test (0: no evaluation)")
    p.add_argument("--out", default="", help="where the runs go (default: a temporary directory)")
    p.add_argument("--extra", nargs="*", default=[], help="more --config overrides for every run, e.g. total_steps=4")
    p.add_argument("--compile-cache", choices=("cold", "shared"), default="cold",
                   help="cold: each run compiles from nothing (its loop time is a new user's); shared: later runs load "
                        "the programs of the first from OUT/xla-cache (quicker, wall times then not comparable)")
    args = p.parse_args(argv)
    if args.tasks < 1 or args.steps < 1 or args.solved < 0 or args.unsolved < 0:
        p.error("--tasks and --steps must be >= 1, --solved and --unsolved >= 0")
    if not (args.solved or args.unsolved):
        p.error("--solved and --unsolved are both 0: the retiring runs would retire nothing")
    return args


def write_subset(n: int, path: str) -> int:
    """The first n rows of the default training set into path; the number written."""
    with open(TRAIN) as src, open(path, "w") as dst:
        rows = [line for _, line in zip(range(n), src)]
        dst.writelines(rows)
    return len(rows)


def read_run(run_dir: str) -> dict:
    """A finished run's figures from its summary.json and metrics.jsonl (one row per update)."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "uniform_group_fraction" in r]
    uniform = float(np.mean([r["uniform_group_fraction"] for r in rows]))
    groups = 16 * len(rows)
    last = rows[-1]
    end = summary["evaluations"].get("end", {})
    return {
        "steps": summary["steps"], "loop_s": summary["wall_s"],
        "uniform_group_share": uniform,
        "advantage_groups_per_min": groups * (1 - uniform) / (summary["wall_s"] / 60),
        "generated_tokens": float(sum(r.get("sampler/step_tokens", 0.0) for r in rows)),
        "train_accuracy_last_quarter": float(np.mean([r["accuracy"] for r in rows[-max(1, len(rows) // 4):]])),
        "test_greedy": end.get("greedy_pass@1"),
        "retired_solved": summary["retired_tasks"]["retired_solved"],
        "retired_unsolved": summary["retired_tasks"]["retired_unsolved"],
        "retirement_resets": summary["retired_tasks"]["retirement_resets"],
        "skipped_prompts": float(last.get("rollout/skipped_retired", 0.0)),
        "matmul_peak_gflops": summary.get("matmul_peak_gflops"),
    }


FIELDS = (("uniform_group_share", "{:.1%}"), ("advantage_groups_per_min", "{:.1f}"), ("generated_tokens", "{:,.0f}"),
          ("loop_s", "{:.1f}"), ("train_accuracy_last_quarter", "{:.1%}"), ("test_greedy", "{:.1%}"),
          ("retired_solved", "{:d}"), ("retired_unsolved", "{:d}"), ("skipped_prompts", "{:,.0f}"))


def _fmt(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(int(v) if fmt == "{:d}" else v)


def mean_of(runs: list[dict]) -> dict:
    out = {}
    for key, _ in FIELDS:
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = float(np.mean(vals)) if vals else None
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import jax

    device = jax.devices()[0].device_kind
    out = args.out or tempfile.mkdtemp(prefix="retirement-")
    os.makedirs(out, exist_ok=True)
    subset = os.path.join(out, "train.jsonl")
    kept = write_subset(args.tasks, subset)
    passes = args.steps * 16 / kept
    print(f"Retirement benchmark on {device} ({platform.machine()}, {os.cpu_count()} cores): default "
          f"math job, first {kept} training tasks, {args.steps} updates = {passes:.1f} passes over them; "
          f"retiring runs: rollout.retire_solved={args.solved}, retire_unsolved={args.unsolved}.", flush=True)
    common = [f"data.train_path={subset}", f"total_steps={args.steps}", f"eval.n_test={args.n_test}",
              f"eval.at_start={args.n_test > 0}", "checkpoint.every_steps=0", *args.extra]
    variants = {"none": ["rollout.retire_solved=0", "rollout.retire_unsolved=0"],
                "retire": [f"rollout.retire_solved={args.solved}", f"rollout.retire_unsolved={args.unsolved}"]}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for seed in args.seeds:
        for name, extra in variants.items():
            run_dir = os.path.join(out, f"{name}_seed{seed}")
            cache = os.path.join(run_dir if args.compile_cache == "cold" else out, "xla-cache")
            env = {**os.environ, "AREAL_JAX_COMPILE_CACHE": cache}
            run_main_job(CONFIG, run_dir, [*common, f"seed={seed}", *extra], env=env)
            runs[name].append(read_run(run_dir))
            got = runs[name][-1]
            print(f"  seed {seed} {name:>6}: " + ", ".join(f"{k} {_fmt(f, got[k])}" for k, f in FIELDS)
                  + f" (matmul peak {got['matmul_peak_gflops'] or 0:.0f} GFLOP/s)", flush=True)
    means = {name: mean_of(r) for name, r in runs.items()}
    print(f"\nmean over seeds {args.seeds}:")
    print(f"{'':30s}{'none':>14s}{'retire':>14s}{'retire/none':>14s}")
    ratios = {}
    for key, fmt in FIELDS:
        a, b = means["none"][key], means["retire"][key]
        ratio = b / a if a and b is not None else None
        ratios[key] = ratio
        print(f"{key:30s}{_fmt(fmt, a):>14s}{_fmt(fmt, b):>14s}{_fmt('{:.2f}x', ratio):>14s}")
    report = {"benchmark": "retirement", "device": device, "cores": os.cpu_count(), "tasks": kept,
              "compile_cache": args.compile_cache,
              "steps": args.steps, "passes": passes, "seeds": args.seeds, "retire_solved": args.solved,
              "retire_unsolved": args.unsolved, "runs": runs, "mean": means, "ratio_retire_over_none": ratios}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
