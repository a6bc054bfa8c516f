"""Plots of a run: `python -m areal_jax.programs.report RUN_DIR [--out DIR]` writes into RUN_DIR/plots (or DIR):

- curves.png: training reward and accuracy against steps and against wall time (plus eval points);
- timeline.png: when the sampler and the trainer were busy (from timeline.json), with each lane's
  busy fraction, which is where asynchronous RL's gain shows;
- tasks.csv: per training task (dataset file and row), from samples*.jsonl: the groups and samples trained on
  it, how many samples solved it (reward >= 1) and their mean reward; the tasks never solved in two groups or
  more come first. A task no sample ever solves gives group advantages of zero: compute spent on no signal, and
  with a policy that solves its neighbours, often a sign of wrong tests or a wrong answer key. The command prints
  how many tasks that is and the share of the samples they took.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections import defaultdict
from typing import Iterable, Iterator

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from areal_jax import paths  # noqa: E402  (run directories may be file:// or object-store URLs)
from areal_jax.system.retire import SOLVED, task_key  # noqa: E402  (the job's solved threshold and task key)


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


def _names(rows: list[dict], prefix: str, suffix: str) -> list[str]:
    return list(dict.fromkeys(k[len(prefix):-len(suffix)] for r in rows for k in r
                              if k.startswith(prefix) and k.endswith(suffix) and k.count("/") == 2))


def eval_set_names(rows: list[dict]) -> list[str]:
    """The evaluation sets a run's metrics name (eval/<set>/greedy_pass@1), in order of first appearance."""
    return _names(rows, "eval/", "/greedy_pass@1")


def source_names(rows: list[dict]) -> list[str]:
    """The training files of a mixture a run's metrics name (source/<name>/reward), in order of first appearance."""
    return _names(rows, "source/", "/reward")


def plot_curves(rows: list[dict], out: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x, label in ((axes[0], "step", "step"), (axes[1], "time/elapsed_s", "wall time (s)")):
        for key, style in (("reward", "-"), ("accuracy", "--")):
            xs, ys = _series(rows, key, x)
            if xs:
                ax.plot(xs, ys, style, label=f"train {key}")
        for name in source_names(rows):  # a mixture of training files: each file's reward
            xs, ys = _series(rows, f"source/{name}/reward", x)
            ax.plot(xs, ys, ":", label=f"train reward ({name})")
        xs, ys = _series(rows, "eval/greedy_pass@1", x if x == "step" else "step")
        if xs and x == "step":
            ax.plot(xs, ys, "o", label="test greedy pass@1")
            for name in eval_set_names(rows):  # several evaluation sets: each set's own points beside the pooled
                xs, ys = _series(rows, f"eval/{name}/greedy_pass@1", "step")
                ax.plot(xs, ys, "x", label=f"{name} greedy pass@1")
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


# matplotlib's ten default colours, then eight that differ from them: a job's lanes hold a dozen kinds of span.
SPAN_COLORS = [f"C{i}" for i in range(10)] + ["black", "gold", "teal", "lime", "navy", "salmon", "darkviolet", "peru"]


def plot_timeline(spans: dict, out: str) -> None:
    fig, ax = plt.subplots(figsize=(11, 1.5 + 0.6 * max(1, len(spans))))
    if spans:
        t0 = min(s for v in spans.values() for s, _, _ in v)
        colors = {}
        frac = busy_fractions(spans)
        for i, (lane, v) in enumerate(sorted(spans.items())):
            kinds: dict[str, list[tuple[float, float]]] = {}  # one draw call per span kind of a lane
            for s, d, name in v:
                colors.setdefault(name, SPAN_COLORS[len(colors) % len(SPAN_COLORS)])
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


TASK_COLUMNS = ("task", "groups", "samples", "solved", "solve_rate", "mean_reward", "first_trained_version",
                "last_trained_version", "retired")


def read_samples(run_dir: str) -> Iterator[dict]:
    """Rows of the run's samples.jsonl (samples.process_<i>.jsonl of every process in a multi-process run), one
    per trained group, read line by line (a long run's log need not fit in memory). A line a kill cut short is
    skipped."""
    root = paths.join(run_dir)
    files = sorted(f for f in root.iterdir() if f.name.startswith("samples") and f.name.endswith(".jsonl")) \
        if root.exists() else []
    for f in files:
        with f.open("r") as lines:
            for line in lines:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue


def task_outcomes(rows: Iterable[dict], min_groups: int = 2) -> tuple[list[dict], dict]:
    """(one dict per task with TASK_COLUMNS, never-solved tasks of min_groups groups or more first, then by solve
    rate; a summary). A task is a uid without its epoch ("<file>:<row>")."""
    tasks = {}
    for r in rows:
        key = task_key(r["uid"])
        t = tasks.setdefault(key, {"task": key, "groups": 0, "samples": 0, "solved": 0, "reward_sum": 0.0,
                                   "first_trained_version": r["trained_version"], "last_trained_version": 0,
                                   "uniform_groups": 0})
        rewards = [float(x) for x in r["rewards"]]
        t["groups"] += 1
        t["samples"] += len(rewards)
        t["solved"] += sum(x >= SOLVED for x in rewards)
        t["reward_sum"] += sum(rewards)
        t["uniform_groups"] += int(len(set(rewards)) <= 1)
        t["first_trained_version"] = min(t["first_trained_version"], r["trained_version"])
        t["last_trained_version"] = max(t["last_trained_version"], r["trained_version"])
    table = []
    for t in tasks.values():
        t["solve_rate"] = t["solved"] / max(t["samples"], 1)
        t["mean_reward"] = t.pop("reward_sum") / max(t["samples"], 1)
        table.append(t)
    never = [t for t in table if t["groups"] >= min_groups and t["solved"] == 0]
    always = [t for t in table if t["groups"] >= min_groups and t["solved"] == t["samples"]]
    table.sort(key=lambda t: (not (t["groups"] >= min_groups and t["solved"] == 0), t["solve_rate"], -t["samples"],
                              t["task"]))
    samples = max(sum(t["samples"] for t in table), 1)
    groups = max(sum(t["groups"] for t in table), 1)
    summary = {
        "tasks": len(table), "groups": sum(t["groups"] for t in table), "min_groups": min_groups,
        "tasks_in_min_groups": sum(t["groups"] >= min_groups for t in table),
        "never_solved": len(never), "never_solved_sample_share": sum(t["samples"] for t in never) / samples,
        "always_solved": len(always), "always_solved_sample_share": sum(t["samples"] for t in always) / samples,
        "uniform_group_share": sum(t.pop("uniform_groups") for t in table) / groups,
    }
    return table, summary


def read_retired(run_dir: str) -> dict[str, str]:
    """The tasks retired (rollout.retire_solved / retire_unsolved; task -> "solved" | "unsolved") at the run's latest
    checkpoint, over every process's meta file; {} when the run saved none."""
    root = paths.join(run_dir, "checkpoint_meta")
    steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True) if root.exists() else []
    for step in steps:
        files = [f for f in (root / str(step)).iterdir() if f.name.startswith("process_") and f.name.endswith(".json")]
        if not files:
            continue
        retired: dict[str, str] = {}
        for f in files:
            retired.update((json.loads(f.read_text()).get("retirement") or {}).get("retired", {}))
        return retired
    return {}


def write_task_table(run_dir: str, out: str | None = None, min_groups: int = 2) -> tuple[str, dict] | None:
    """Write tasks.csv into `out` (default RUN_DIR/plots); returns (its path, the summary), or None when the run
    recorded no samples (log.samples off, or no step trained yet). Its `retired` column says which tasks the run had
    retired at its latest checkpoint (system/retire.py), and how."""
    table, summary = task_outcomes(read_samples(run_dir), min_groups)
    if not table:
        return None
    retired = read_retired(run_dir)
    for t in table:
        t["retired"] = retired.get(t["task"], "")
    summary["retired_solved"] = sum(kind == "solved" for kind in retired.values())
    summary["retired_unsolved"] = len(retired) - summary["retired_solved"]
    out_dir = paths.join(out) if out else paths.join(run_dir, "plots")
    paths.makedirs(out_dir)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=TASK_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for t in table:
        writer.writerow({k: round(v, 6) if isinstance(v, float) else v for k, v in t.items()})
    path = out_dir / "tasks.csv"
    with paths.atomic_open(path, "w") as f:
        f.write(buf.getvalue())
    return str(path), summary


def task_lines(summary: dict) -> list[str]:
    """The summary of write_task_table in words."""
    s, k = summary, summary["min_groups"]
    return [
        f"tasks: {s['tasks']:,} trained in {s['groups']:,} groups ({s['tasks_in_min_groups']:,} in {k} groups or "
        f"more); groups whose samples all scored alike (no group advantage): {s['uniform_group_share']:.1%}",
        f"never solved in {k} groups or more: {s['never_solved']:,} tasks, {s['never_solved_sample_share']:.1%} of "
        f"the samples (check their tests or answers; code sets: python -m areal_jax.programs.check_code_data); "
        f"solved by every sample: {s['always_solved']:,} tasks, {s['always_solved_sample_share']:.1%}",
    ] + ([f"retired at the latest checkpoint (rollout.retire_solved / retire_unsolved): {s['retired_solved']:,} "
          f"solved, {s['retired_unsolved']:,} unsolved"] if s.get("retired_solved") or s.get("retired_unsolved") else [])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m areal_jax.programs.report",
        description="Plot a run of areal_jax.main: curves.png (reward and test accuracy against steps and wall "
                    "time), timeline.png (when the trainer, sampler and reward lanes were busy) and tasks.csv (per "
                    "training task: groups, samples, solve rate; never-solved tasks first).")
    parser.add_argument("run_dir", help="the run's directory (config.run_dir; holds metrics.jsonl, timeline.json)")
    parser.add_argument("--out", default=None, help="directory for the PNGs and tasks.csv (default: RUN_DIR/plots)")
    parser.add_argument("--min-groups", type=int, default=2, help="a task counts as never (or always) solved once "
                        "trained in this many groups")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if not paths.join(args.run_dir, "metrics.jsonl").exists():
        print(f"error: {args.run_dir!r} is not a run directory (it has no metrics.jsonl); pass the run_dir of a "
              "run of areal_jax.main, e.g. runs/math.", file=sys.stderr)
        sys.exit(2)
    if args.min_groups < 1:
        print(f"error: --min-groups={args.min_groups} must be at least 1.", file=sys.stderr)
        sys.exit(2)
    for p in make_report(args.run_dir, args.out):
        print(p)
    tasks = write_task_table(args.run_dir, args.out, args.min_groups)
    if tasks is None:
        print("no samples*.jsonl in the run directory (log.samples off, or no step trained): no tasks.csv",
              file=sys.stderr)
    else:
        print(tasks[0])
        print("\n".join(task_lines(tasks[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
