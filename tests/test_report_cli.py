"""`python -m areal_jax.programs.report`: a command line with --help, --out and a one-line error for a directory
that is not a run; the timeline is drawn with one call per lane and span kind and looks as it did when
every span had its own call."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from areal_jax.programs import report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {"trainer": ["wait_batch", "train_step", "publish"], "sampler": ["decode_step", "admit_prefill"],
         "rewards": ["reward"]}


def _report(*args):
    return subprocess.run([sys.executable, "-m", "areal_jax.programs.report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with metrics.jsonl and a timeline of 900 back-to-back spans on three lanes."""
    rng = np.random.default_rng(0)
    d = tmp_path / "run"
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for step in range(1, 31):
            f.write(json.dumps({"step": step, "reward": step / 30, "time/elapsed_s": 2.0 * step}) + "\n")
    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
              for tid, lane in enumerate(KINDS, start=1)]
    for tid, (lane, kinds) in enumerate(KINDS.items(), start=1):
        t = 0
        for _ in range(300):
            dur = int(rng.integers(3_000_000, 8_000_000))  # seconds: each span a few pixels wide
            events.append({"name": kinds[int(rng.integers(len(kinds)))], "ph": "X", "ts": t, "dur": dur,
                           "pid": 1, "tid": tid, "args": {}})
            t += dur + int(rng.integers(0, 2_000_000))
    (d / "timeline.json").write_text(json.dumps({"traceEvents": events}))
    return str(d)


def _timeline_one_call_per_span(spans: dict, out: str) -> None:
    """The reference: the report's timeline as it was drawn before, one broken_barh call per span."""
    fig, ax = plt.subplots(figsize=(11, 1.5 + 0.6 * max(1, len(spans))))
    t0 = min(s for v in spans.values() for s, _, _ in v)
    colors = {}
    frac = report.busy_fractions(spans)
    for i, (lane, v) in enumerate(sorted(spans.items())):
        for s, d, name in v:
            c = colors.setdefault(name, f"C{len(colors) % 10}")
            ax.broken_barh([(s - t0, max(d, 1e-4))], (i - 0.4, 0.8), color=c,
                           alpha=0.3 if name.startswith("wait") else 1)
        ax.text(0, i + 0.42, f"{lane}: busy {100 * frac[lane]:.0f}%", fontsize=8)
    ax.set_yticks(range(len(spans)), sorted(spans))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=7, ncol=min(8, len(colors)), loc="lower center",
              bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.set_xlabel("wall time (s)")
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)


def test_timeline_is_one_call_per_lane_and_kind_with_the_same_picture(run_dir, tmp_path, monkeypatch):
    spans = report.read_spans(run_dir)
    calls = []
    real = matplotlib.axes.Axes.broken_barh
    monkeypatch.setattr(matplotlib.axes.Axes, "broken_barh",
                        lambda self, xranges, *a, **k: calls.append(len(xranges)) or real(self, xranges, *a, **k))
    report.plot_timeline(spans, str(tmp_path / "new.png"))
    assert len(calls) == sum(len(k) for k in KINDS.values()) and sum(calls) == 900
    monkeypatch.setattr(matplotlib.axes.Axes, "broken_barh", real)
    _timeline_one_call_per_span(spans, str(tmp_path / "old.png"))
    new, old = mpimg.imread(tmp_path / "new.png"), mpimg.imread(tmp_path / "old.png")
    assert new.shape == old.shape
    # Only anti-aliased pixels at span edges may differ (the drawing order of two neighbouring spans of
    # different kinds decides them): every run of differing pixels along a row is at most 2 pixels wide.
    differs = np.abs(new - old).max(axis=-1) > 0.02
    assert differs.mean() < 0.05
    padded = np.pad(differs, ((0, 0), (1, 1))).astype(np.int8)
    edges = np.diff(padded, axis=1)
    widths = np.nonzero(edges == -1)[1] - np.nonzero(edges == 1)[1]
    assert widths.size == 0 or widths.max() <= 2, widths.max()


def test_every_kind_of_span_gets_its_own_colour(tmp_path, monkeypatch):
    # A job's timeline holds a dozen kinds (checkpoint_write and eval_end were both drawn in C0 with ten colours).
    names = [f"kind{i}" for i in range(14)]
    spans = {"trainer": [(float(i), 0.5, n) for i, n in enumerate(names[:7])],
             "checkpoint": [(float(i), 0.5, n) for i, n in enumerate(names[7:])]}
    drawn = {}
    real = matplotlib.axes.Axes.broken_barh
    monkeypatch.setattr(matplotlib.axes.Axes, "broken_barh",
                        lambda self, xranges, yrange, **k: drawn.setdefault(yrange, []).append(k["color"])
                        or real(self, xranges, yrange, **k))
    report.plot_timeline(spans, str(tmp_path / "t.png"))
    colours = [matplotlib.colors.to_rgba(c) for lane in drawn.values() for c in lane]
    assert len(colours) == 14 and len(set(colours)) == 14


def test_help_and_out(run_dir, tmp_path):
    out = _report("--help")
    assert out.returncode == 0 and "--out" in out.stdout and "run_dir" in out.stdout, out.stderr
    res = _report(run_dir, "--out", str(tmp_path / "pngs"))
    assert res.returncode == 0, res.stderr
    written = res.stdout.split()
    assert [os.path.basename(p) for p in written] == ["curves.png", "timeline.png"]
    for p in written:
        assert os.path.dirname(p) == str(tmp_path / "pngs")
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_directory_that_is_not_a_run_is_one_line_exit_2(tmp_path):
    res = _report(str(tmp_path))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a run directory" in lines[0] and "Traceback" not in res.stderr
