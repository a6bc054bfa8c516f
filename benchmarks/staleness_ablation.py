"""The paper's staleness ablation on the default math job: accuracy vs eta for decoupled PPO and plain PPO.

    python benchmarks/staleness_ablation.py                       # 7 etas x 2 losses x 3 seeds
    python benchmarks/staleness_ablation.py --etas 0,4,16 --seeds 2 --steps 30 --lr 3e-4
    python benchmarks/staleness_ablation.py --report_only         # the figures of the cells finished so far

Every cell (eta, loss, seed) is one run of `python -m areal_jax.main --config=CONFIG` in its own process
(the same command on a CPU or an accelerator), written to OUT/cells/<loss>_eta<k>_seed<s>/. A cell that
finished has a cell.json there and is skipped when the sweep is run again, so a half-finished sweep
resumes where it stopped (a cell killed midway is run again from its start). Per (eta, loss) over seeds:
held-out greedy and sampled pass@1 (mean and sample standard deviation), wall time of the training
loop, trained tokens/s and the distribution of staleness (trainer version minus the oldest token
version of each trained group, from samples.jsonl). Writes OUT/table.md (beside the paper's AIME24
numbers), OUT/accuracy_vs_eta.png (accuracy with error bars per loss; throughput on a second axis) and
OUT/results.json; the last line printed is the same JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from common import run_main_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ETAS = "0,1,2,4,8,16,unbounded"
# The paper's Table (1.5B model, AIME24): eta -> (plain PPO, decoupled PPO); eta 0 is the oracle, 42.0.
PAPER = {0: (42.0, 42.0), 1: (41.8, 42.1), 2: (40.0, 41.8), 4: (23.3, 42.2), 8: (35.7, 41.0), 16: (35.8, 38.7),
         None: (34.0, 36.9)}


def eta_name(eta: int | None) -> str:
    return "unbounded" if eta is None else str(eta)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "math.py"))
    p.add_argument("--etas", default=DEFAULT_ETAS, help="comma-separated, 'unbounded' for no bound")
    p.add_argument("--losses", default="decoupled,ppo")
    p.add_argument("--seeds", default="3", help="a count N (seeds 0..N-1) or a comma-separated list")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--n_test", type=int, default=500)
    p.add_argument("--lr", type=float, help="train.lr (default: the config's)")
    p.add_argument("--group_size", type=int, help="rollout.group_size (default: the config's)")
    p.add_argument("--unbounded_concurrent", type=int, default=64, help="groups in flight when eta is unbounded")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config override, e.g. --set train.batch_groups=8 (repeatable)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "staleness_ablation"))
    p.add_argument("--report_only", action="store_true",
                   help="run no cell: rewrite the table, figure and JSON over the cells already finished")
    args = p.parse_args(argv)
    try:
        args.eta_list = [None if e.strip() in ("unbounded", "inf", "-1") else int(e) for e in args.etas.split(",")]
    except ValueError:
        p.error(f"--etas={args.etas!r}: give comma-separated integers >= 0 or 'unbounded', e.g. --etas=0,4,unbounded.")
    if any(e is not None and e < 0 for e in args.eta_list):
        p.error(f"--etas={args.etas!r}: each eta must be >= 0 or 'unbounded'.")
    args.loss_list = [x.strip() for x in args.losses.split(",") if x.strip()]
    if not args.loss_list or any(x not in ("decoupled", "ppo") for x in args.loss_list):
        p.error(f"--losses={args.losses!r}: give decoupled, ppo or both, comma-separated.")
    try:
        s = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds={args.seeds!r}: give a count (e.g. 3) or a comma-separated list of seeds (e.g. 0,1,2).")
    args.seed_list = list(range(s[0])) if len(s) == 1 else s
    if not args.seed_list:
        p.error(f"--seeds={args.seeds!r} gives no seed; use at least 1.")
    for kv in args.set:
        if "=" not in kv or not kv.split("=", 1)[0]:
            p.error(f"--set {kv!r}: write it as KEY=VALUE, e.g. --set train.lr=3e-4.")
    if args.steps < 1:
        p.error(f"--steps={args.steps} must be at least 1.")
    return args


def regime_overrides(args: argparse.Namespace) -> list[str]:
    """The regime the flags ask for (learning rate, group size, --set), as `key=value`."""
    out = [] if args.lr is None else [f"train.lr={args.lr}"]
    if args.group_size is not None:
        out.append(f"rollout.group_size={args.group_size}")
    return out + list(args.set)


def sweep_overrides(args: argparse.Namespace) -> list[str]:
    """Config overrides shared by every cell, as `key=value`."""
    return [f"total_steps={args.steps}", f"eval.n_test={args.n_test}", "eval.at_start=False",
            "checkpoint.resume=False", "checkpoint.every_steps=0", "log.console=False"] + regime_overrides(args)


def cell_overrides(eta: int | None, loss: str, seed: int, unbounded_concurrent: int) -> list[str]:
    out = [f"seed={seed}", f"train.loss={loss}", f"rollout.max_staleness={-1 if eta is None else eta}"]
    if eta is None:
        out.append(f"rollout.max_concurrent={unbounded_concurrent}")
    return out


def run_cell(config: str, overrides: list[str], run_dir: str) -> None:
    """One run of the main job in its own process (common.run_main_job)."""
    run_main_job(config, run_dir, overrides)


def read_cell(run_dir: str) -> dict:
    """What one finished run gives: end-of-run accuracy, wall time, throughput, staleness per group."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    rows = [json.loads(ln) for ln in open(os.path.join(run_dir, "samples.jsonl")) if ln.strip()]
    stale = [r["trained_version"] - r["min_token_version"] for r in rows]
    end = summary["evaluations"].get("end", {})
    return {"greedy": end.get("greedy_pass@1"), "sampled": end.get("sampled_pass@1"), "n_test": end.get("n"),
            "wall_s": summary["wall_s"], "trained_tokens_per_s": summary["trained_tokens_per_s"],
            "reward_last_quarter": summary["reward_last_quarter"], "steps": summary["steps"],
            "staleness_hist": {str(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))}}


def mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (ddof 1; 0 for a single value) of the non-missing values."""
    v = [x for x in values if x is not None]
    if not v:
        return None, None
    return float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0


def aggregate(cells: dict[tuple, dict], etas: list, losses: list[str], seeds: list[int]) -> list[dict]:
    """One row per (eta, loss) with the statistics over the seeds that finished."""
    rows = []
    for eta in sorted(etas, key=lambda e: float("inf") if e is None else e):
        for loss in losses:
            got = [cells[(eta, loss, s)] for s in seeds if (eta, loss, s) in cells]
            if not got:
                continue
            hist: dict[str, int] = {}
            for c in got:
                for k, v in c["staleness_hist"].items():
                    hist[k] = hist.get(k, 0) + v
            total = sum(hist.values())
            g, gs = mean_std([c["greedy"] for c in got])
            s, ss = mean_std([c["sampled"] for c in got])
            rows.append({"eta": eta_name(eta), "loss": loss, "seeds": len(got), "greedy_mean": g, "greedy_std": gs,
                         "sampled_mean": s, "sampled_std": ss,
                         "wall_s": float(np.mean([c["wall_s"] for c in got])),
                         "trained_tokens_per_s": float(np.mean([c["trained_tokens_per_s"] for c in got])),
                         "staleness_mean": sum(int(k) * v for k, v in hist.items()) / max(1, total),
                         "staleness_max": max(int(k) for k in hist) if hist else None, "staleness_hist": hist})
    return rows


def verdict(rows: list[dict], metric: str = "greedy") -> dict:
    """The issue's test: at the largest eta where plain PPO's accuracy falls below its eta-0 value by more
    than 2 spreads (spread: the pooled standard deviation over seeds of the two cells), does decoupled
    PPO lose less than half as much? Drops are against each loss's own eta-0 cell."""
    by = {(r["eta"], r["loss"]): r for r in rows}
    base = {loss: by.get(("0", loss)) for loss in ("ppo", "decoupled")}
    if not all(base.values()):
        return {"decided": False, "why": "needs eta 0 for both losses"}
    per_eta, largest = [], None
    for r in rows:
        if r["loss"] != "ppo" or r["eta"] == "0" or (r["eta"], "decoupled") not in by:
            continue
        d = by[(r["eta"], "decoupled")]
        ppo_drop = base["ppo"][f"{metric}_mean"] - r[f"{metric}_mean"]
        dec_drop = base["decoupled"][f"{metric}_mean"] - d[f"{metric}_mean"]
        spread = float(np.sqrt((base["ppo"][f"{metric}_std"] ** 2 + r[f"{metric}_std"] ** 2) / 2))
        significant = r["seeds"] > 1 and ppo_drop > 2 * spread
        per_eta.append({"eta": r["eta"], "ppo_drop": ppo_drop, "decoupled_drop": dec_drop, "spread": spread,
                        "ppo_drop_significant": significant})
        if significant:
            largest = per_eta[-1]
    if largest is None:
        return {"decided": True, "metric": metric, "ppo_degrades": False, "per_eta": per_eta}
    return {"decided": True, "metric": metric, "ppo_degrades": True, "at_eta": largest["eta"],
            "decoupled_holds": largest["decoupled_drop"] < largest["ppo_drop"] / 2, "per_eta": per_eta}


def _fmt(m: float | None, s: float | None) -> str:
    return "-" if m is None else f"{100 * m:.1f} ± {100 * (s or 0):.1f}"


def write_table(rows: list[dict], path: str, header: str) -> str:
    by = {(r["eta"], r["loss"]): r for r in rows}
    etas = list(dict.fromkeys(r["eta"] for r in rows))
    lines = [header, "",
             "| eta | paper: PPO | paper: decoupled | PPO greedy | decoupled greedy | PPO sampled | decoupled sampled "
             "| trained tok/s (PPO / dec.) | wall s (PPO / dec.) | staleness mean / max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in etas:
        p, d = by.get((e, "ppo")), by.get((e, "decoupled"))
        paper = PAPER.get(None if e == "unbounded" else int(e))
        any_row = p or d

        def pick(r, key, f="{:.0f}"):
            return "-" if r is None else f.format(r[key])

        lines.append(
            f"| {e} | {paper[0] if paper else '-'} | {paper[1] if paper else '-'} "
            f"| {_fmt(p and p['greedy_mean'], p and p['greedy_std'])} | {_fmt(d and d['greedy_mean'], d and d['greedy_std'])} "
            f"| {_fmt(p and p['sampled_mean'], p and p['sampled_std'])} | {_fmt(d and d['sampled_mean'], d and d['sampled_std'])} "
            f"| {pick(p, 'trained_tokens_per_s')} / {pick(d, 'trained_tokens_per_s')} "
            f"| {pick(p, 'wall_s')} / {pick(d, 'wall_s')} "
            f"| {any_row['staleness_mean']:.2f} / {any_row['staleness_max']} |")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = list(dict.fromkeys(r["eta"] for r in rows))
    x = np.arange(len(etas))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax2 = ax.twinx()
    for k, (loss, color) in enumerate((("decoupled", "tab:blue"), ("ppo", "tab:red"))):
        sel = {r["eta"]: r for r in rows if r["loss"] == loss}
        if not sel:
            continue
        xs = [i + (k - 0.5) * 0.08 for i, e in enumerate(etas) if e in sel]
        for metric, style in (("greedy", "-o"), ("sampled", ":s")):
            ys = [100 * sel[e][f"{metric}_mean"] if sel[e][f"{metric}_mean"] is not None else np.nan
                  for e in etas if e in sel]
            err = [100 * (sel[e][f"{metric}_std"] or 0) for e in etas if e in sel]
            ax.errorbar(xs, ys, yerr=err, fmt=style, color=color, capsize=3, label=f"{loss} {metric} pass@1")
        ax2.plot(xs, [sel[e]["trained_tokens_per_s"] for e in etas if e in sel], "--", color=color, alpha=0.4,
                 label=f"{loss} trained tok/s")
    ax.set_xticks(x, etas)
    ax.set_xlabel("staleness bound eta")
    ax.set_ylabel("held-out pass@1 (%), mean ± sd over seeds")
    ax2.set_ylabel("trained tokens/s (dashed)")
    ax.grid(alpha=0.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(args: argparse.Namespace, settings: dict, cells: dict, ran: int, sweep_s: float) -> dict:
    """table.md, accuracy_vs_eta.png and results.json over the cells finished so far (rewritten after every
    cell, so a sweep stopped by a time limit still leaves its figures)."""
    rows = aggregate(cells, args.eta_list, args.loss_list, args.seed_list)
    header = (f"Staleness ablation: {os.path.relpath(args.config, ROOT)}, {args.steps} steps, "
              f"{len(args.seed_list)} seed(s), {args.n_test} test problems; overrides: {' '.join(regime_overrides(args)) or 'none'}. "
              "Ours: held-out pass@1 (%) mean ± sd over seeds; paper: AIME24, 1.5B model.")
    table = write_table(rows, os.path.join(args.out, "table.md"), header)
    plot(rows, os.path.join(args.out, "accuracy_vs_eta.png"))
    report = {"benchmark": "staleness_ablation", "settings": settings, "etas": [eta_name(e) for e in args.eta_list],
              "losses": args.loss_list, "seeds": args.seed_list, "cells_run": ran, "sweep_s": sweep_s, "rows": rows,
              "verdict": {m: verdict(rows, m) for m in ("greedy", "sampled")},
              "cells": {f"{loss}_eta{eta_name(e)}_seed{s}": c for (e, loss, s), c in cells.items()}}
    with open(os.path.join(args.out, "results.json") + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(os.path.join(args.out, "results.json") + ".tmp", os.path.join(args.out, "results.json"))
    report["table"] = table
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(os.path.join(args.out, "cells"), exist_ok=True)
    shared = sweep_overrides(args)
    settings = {"config": os.path.abspath(args.config), "overrides": shared,
                "unbounded_concurrent": args.unbounded_concurrent}
    spath = os.path.join(args.out, "sweep.json")
    if os.path.exists(spath):
        with open(spath) as f:
            old = json.load(f)
        if old != settings:
            raise SystemExit(f"{args.out} holds a sweep with other settings ({old}); pass another --out to start "
                             "a new sweep, or the same --config / --steps / --n_test / overrides to resume it.")
    else:
        with open(spath, "w") as f:
            json.dump(settings, f, indent=1)
    cells, t_sweep, ran = {}, time.perf_counter(), 0
    grid = [(e, loss, s) for s in args.seed_list for e in args.eta_list for loss in args.loss_list]
    for i, (eta, loss, seed) in enumerate(grid):
        name = f"{loss}_eta{eta_name(eta)}_seed{seed}"
        run_dir = os.path.join(args.out, "cells", name)
        done = os.path.join(run_dir, "cell.json")
        if os.path.exists(done):
            with open(done) as f:
                cells[(eta, loss, seed)] = json.load(f)
            print(f"[{i + 1}/{len(grid)}] {name}: finished earlier, skipped", flush=True)
            continue
        if args.report_only:
            print(f"[{i + 1}/{len(grid)}] {name}: not run yet (--report_only)", flush=True)
            continue
        t0 = time.perf_counter()
        run_cell(args.config, shared + cell_overrides(eta, loss, seed, args.unbounded_concurrent), run_dir)
        cell = {**read_cell(run_dir), "process_s": time.perf_counter() - t0}
        with open(done + ".tmp", "w") as f:
            json.dump(cell, f)
        os.replace(done + ".tmp", done)  # written last: its presence means the cell is complete
        cells[(eta, loss, seed)] = cell
        ran += 1
        print(f"[{i + 1}/{len(grid)}] {name}: greedy {cell['greedy']}, sampled {cell['sampled']}, "
              f"{cell['process_s']:.0f} s", flush=True)
        write_report(args, settings, cells, ran, time.perf_counter() - t_sweep)
    report = write_report(args, settings, cells, ran, time.perf_counter() - t_sweep)
    print(report.pop("table"))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
