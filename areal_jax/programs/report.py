"""Plots of a run: `python -m areal_jax.programs.report RUN_DIR [--out DIR]` writes PNGs into RUN_DIR/plots
(or DIR).

- curves.png: training reward and accuracy against steps and against wall time (plus eval points);
- timeline.png: when the sampler and the trainer were busy (from timeline.json), with each lane's
  busy fraction, which is where asynchronous RL's gain shows.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from areal_jax import paths  # noqa: E402  (run directories may be file:// or object-store URLs)


def read_metrics(run_dir: str) -> list[dict]:
    """Rows of RUN_DIR/metrics.jsonl (each has "step" and the logged values)."""
    path = paths.join(run_dir, "metrics.jsonl")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir!r} a run directory of areal_jax.main?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_spans(run_dir: str) -> dict[str, list[tuple[float, float, str]]]:
    """Complete spans of timeline.json grouped by lane: {lane: [(start_s, duration_s, name)]}."""
    path = paths.join(run_dir, "timeline.json")
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = e["args"]["name"]
    lanes = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            lane = names.get((e.get("pid"), e.get("tid")), str(e.get("tid")))
            lanes[lane].append((e["ts"] / 1e6, e.get("dur", 0) / 1e6, e["name"]))
    return dict(lanes)


def _series(rows: list[dict], key: str, x: str) -> tuple[list, list]:
    pts = [(r[x], r[key]) for r in rows if key in r and x in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_curves(rows: list[dict], out: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x, label in ((axes[0], "step", "step"), (axes[1], "time/elapsed_s", "wall time (s)")):
        for key, style in (("reward", "-"), ("accuracy", "--")):
            xs, ys = _series(rows, key, x)
            if xs:
                ax.plot(xs, ys, style, label=f"train {key}")
        xs, ys = _series(rows, "eval/greedy_pass@1", x if x == "step" else "step")
        if xs and x == "step":
            ax.plot(xs, ys, "o", label="test greedy pass@1")
        ax.set_xlabel(label)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with paths.atomic_open(out, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def busy_fractions(spans: dict[str, list[tuple[float, float, str]]]) -> dict[str, float]:
    """Share of the traced wall time each lane spent inside spans (waits excluded)."""
    if not spans:
        return {}
    t0 = min(s for v in spans.values() for s, _, _ in v)
    t1 = max(s + d for v in spans.values() for s, d, _ in v)
    total = max(t1 - t0, 1e-9)

    def covered(intervals):  # union length: spans of one lane may overlap (several reward workers)
        length, end = 0.0, -float("inf")
        for s, d in sorted(intervals):
            if s + d > end:
                length += s + d - max(s, end)
                end = s + d
        return length

    return {lane: covered([(s, d) for s, d, n in v if not n.startswith("wait")]) / total
            for lane, v in spans.items()}


def plot_timeline(spans: dict, out: str) -> None:
    fig, ax = plt.subplots(figsize=(11, 1.5 + 0.6 * max(1, len(spans))))
    if spans:
        t0 = min(s for v in spans.values() for s, _, _ in v)
        colors = {}
        frac = busy_fractions(spans)
        for i, (lane, v) in enumerate(sorted(spans.items())):
            kinds: dict[str, list[tuple[float, float]]] = {}  # one draw call per span kind of a lane
            for s, d, name in v:
                colors.setdefault(name, f"C{len(colors) % 10}")
                kinds.setdefault(name, []).append((s - t0, max(d, 1e-4)))
            for name in sorted(kinds, key=lambda n: not n.startswith("wait")):  # waits below busy spans
                ax.broken_barh(kinds[name], (i - 0.4, 0.8), color=colors[name],
                               alpha=0.3 if name.startswith("wait") else 1)
            ax.text(0, i + 0.42, f"{lane}: busy {100 * frac[lane]:.0f}%", fontsize=8)
        ax.set_yticks(range(len(spans)), sorted(spans))
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        ax.legend(handles, list(colors), fontsize=7, ncol=min(8, len(colors)), loc="lower center",
                  bbox_to_anchor=(0.5, 1.0), frameon=False)  # above the lanes, never over a span
    ax.set_xlabel("wall time (s)")
    fig.tight_layout()
    with paths.atomic_open(out, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def make_report(run_dir: str, out: str | None = None) -> list[str]:
    """Write the PNGs into `out` (default RUN_DIR/plots); returns their paths."""
    rows = read_metrics(run_dir)
    out_dir = paths.join(out) if out else paths.join(run_dir, "plots")
    paths.makedirs(out_dir)
    outs = [out_dir / "curves.png", out_dir / "timeline.png"]
    plot_curves(rows, outs[0])
    plot_timeline(read_spans(run_dir), outs[1])
    return [str(p) for p in outs]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m areal_jax.programs.report",
        description="Plot a run of areal_jax.main: curves.png (reward and test accuracy against steps and wall "
                    "time) and timeline.png (when the trainer, sampler and reward lanes were busy).")
    parser.add_argument("run_dir", help="the run's directory (config.run_dir; holds metrics.jsonl, timeline.json)")
    parser.add_argument("--out", default=None, help="directory for the PNGs (default: RUN_DIR/plots)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if not paths.join(args.run_dir, "metrics.jsonl").exists():
        print(f"error: {args.run_dir!r} is not a run directory (it has no metrics.jsonl); pass the run_dir of a "
              "run of areal_jax.main, e.g. runs/math.", file=sys.stderr)
        sys.exit(2)
    for p in make_report(args.run_dir, args.out):
        print(p)


if __name__ == "__main__":
    main(sys.argv[1:])
