"""Asynchronous vs synchronous RL on the default job, side by side in one run.

    python benchmarks/async_vs_sync.py [--steps 20] [--n_test 300] [--out runs/async_vs_sync]

Runs `configs/math.py` with the same seed and number of steps for eta in {0 (synchronous), 1, 4,
unbounded} with the decoupled PPO objective, plus plain PPO (behaviour policy as the proximal one) at
eta = 4 and 8. For each: wall time of the training loop, trained tokens/s, the sampler's mean slot
occupancy, the staleness seen, and final test accuracy (greedy pass@1, sampled pass@1); the speed-up of
each eta over eta = 0 as a ratio; reward-against-wall-time plots in OUT/reward_vs_time.png. The last line
is one JSON object with every figure. On an accelerator the async gain comes from overlapping
generation with training (the paper: 2.77x); on a CPU, where both share the same cores, it comes from
not waiting for the longest generation of each batch.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = [
    ("eta0", {"rollout.max_staleness": 0}),
    ("eta1", {"rollout.max_staleness": 1}),
    ("eta4", {"rollout.max_staleness": 4}),
    ("eta_unbounded", {"rollout.max_staleness": -1, "rollout.max_concurrent": 64}),
    ("ppo_eta4", {"rollout.max_staleness": 4, "train.loss": "ppo"}),
    ("ppo_eta8", {"rollout.max_staleness": 8, "train.loss": "ppo"}),
]


def run_variant(name: str, overrides: dict, args: argparse.Namespace) -> dict:
    run_dir = os.path.join(args.out, name)
    cmd = [sys.executable, "-m", "areal_jax.main", f"--config={ROOT}/configs/math.py",
           f"--config.run_dir={run_dir}", f"--config.total_steps={args.steps}", f"--config.seed={args.seed}",
           "--config.eval.at_start=False", f"--config.eval.n_test={args.n_test}",
           "--config.checkpoint.resume=False", "--config.checkpoint.every_steps=0", "--config.log.console=False"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    train_rows = [r for r in rows if "reward" in r]
    end = summary["evaluations"].get("end", {})
    return {
        "name": name, "process_s": time.perf_counter() - t0, "wall_s": summary["wall_s"],
        "trained_tokens_per_s": summary["trained_tokens_per_s"], "gen_tokens_per_s": summary["tokens_per_s"],
        "occupancy": summary["sampler_occupancy"], "staleness_mean": summary["staleness_mean"],
        "staleness_max": summary["staleness_max"], "reward_last_quarter": summary["reward_last_quarter"],
        "greedy_pass@1": end.get("greedy_pass@1"), "sampled_pass@1": end.get("sampled_pass@1"),
        "curve": [(r["time/elapsed_s"], r["reward"]) for r in train_rows],
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
        ax.plot(xs, ys, "--" if r["name"].startswith("ppo") else "-", label=r["name"])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training reward (batch mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--n_test", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "async_vs_sync"))
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    chosen = [v for v in VARIANTS if not args.only or v[0] in args.only.split(",")]
    results = []
    for name, overrides in chosen:
        print(f"running {name} ...", flush=True)
        results.append(run_variant(name, overrides, args))
    base = next((r for r in results if r["name"] == "eta0"), None)
    header = (f"{'variant':<14} {'wall s':>7} {'speedup':>8} {'train tok/s':>11} {'occupancy':>9} "
              f"{'stale':>6} {'greedy@1':>8} {'sampled@1':>9}")
    print(header)
    for r in results:
        r["speedup_vs_eta0"] = base["wall_s"] / r["wall_s"] if base else None
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"{r['name']:<14} {r['wall_s']:>7.0f} {fmt(r['speedup_vs_eta0'], '>8.2f')} "
              f"{r['trained_tokens_per_s']:>11.0f} {r['occupancy']:>9.2f} {r['staleness_mean']:>6.2f} "
              f"{fmt(r['greedy_pass@1'], '>8.3f')} {fmt(r['sampled_pass@1'], '>9.3f')}")
    plot(results, os.path.join(args.out, "reward_vs_time.png"))
    print(f"plot: {os.path.join(args.out, 'reward_vs_time.png')}")
    print(json.dumps({"benchmark": "async_vs_sync", "steps": args.steps,
                      "results": [{k: v for k, v in r.items() if k != "curve"} for r in results]}))


if __name__ == "__main__":
    main()
