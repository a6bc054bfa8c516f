"""Run metrics: TensorBoard + JSONL writers, a one-line console progress report, a timeline tracer.

* ``MetricsLogger(run_dir)``: ``log(step, {...})`` appends one JSON object per call to
  ``run_dir/metrics.jsonl`` and writes every numeric value as a TensorBoard scalar (tensorboardX event
  file in ``run_dir``); ``progress_line(step, metrics)`` formats step/total, elapsed, ETA and the
  headline numbers. Only process 0 writes by default.
* ``Timeline(path)`` (defined in ``areal_jax.timeline``, importable from here):
  ``with timeline.span("decode_step", lane="sampler", batch=8): ...`` records Chrome trace events.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import threading
import time
from typing import Any, Callable, ClassVar, Mapping

from areal_jax import paths
from areal_jax.knobs import Section, knob, require
from areal_jax.timeline import SpanRecorder, Timeline

__all__ = ["MetricsLogger", "SpanRecorder", "Timeline", "best_seconds", "format_duration", "format_progress", "matmul_peak_gflops", "PROGRESS_KEYS"]

# Headline numbers of the progress line: label -> metric names tried in order (first present wins).
PROGRESS_KEYS: dict[str, tuple[str, ...]] = {
    "reward": ("reward", "reward/mean", "rollout/reward_mean", "train/reward"),
    "acc": ("accuracy", "eval/accuracy", "accuracy/mean", "eval/greedy_pass@1"),
    "tok/s": ("tokens_per_s", "throughput/tokens_per_s", "perf/tokens_per_s", "tokens/s"),
    "staleness": ("staleness", "staleness/mean", "rollout/staleness_mean"),
}


def _to_scalar(value: Any) -> Any:
    """Python scalar for numbers (numpy / jax scalars and size-1 arrays included), the value itself
    for strings, a list for small arrays, None for anything unsupported."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        return value.item()
    if hasattr(value, "tolist") and getattr(value, "size", 0) <= 1024:
        return value.tolist()
    return None


def _flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, prefix=f"{name}/"))
        else:
            out[name] = _to_scalar(value)
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN / Infinity
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def format_duration(seconds: float) -> str:
    """``45s``, ``2m30s``, ``1h02m``: compact, for the progress line."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_progress(step: int, total_steps: int | None, elapsed_s: float,
                    metrics: Mapping[str, Any], *, start_step: int = 0, rate_elapsed_s: float | None = None) -> str:
    """One console line: ``step 25/100 | elapsed 50s | ETA 2m30s | reward 0.512 | ...``.

    ETA = rate_elapsed_s / (step - start_step) * (total_steps - step): the mean time per step since
    start_step (where this process's loop began; non-zero after a resume), times the steps left.
    rate_elapsed_s is the time since start_step was reached (default elapsed_s). Omitted when the
    total is unknown or no step has finished. Headline metrics come from PROGRESS_KEYS; missing ones
    are left out.
    """
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}",
             f"elapsed {format_duration(elapsed_s)}"]
    done = step - start_step
    rate_s = elapsed_s if rate_elapsed_s is None else rate_elapsed_s
    if total_steps and done > 0:
        parts.append(f"ETA {format_duration(rate_s / done * max(0, total_steps - step))}")
    flat = _flatten(metrics)
    for label, names in PROGRESS_KEYS.items():
        value = next((flat[n] for n in names if isinstance(flat.get(n), (int, float))), None)
        if value is None:
            continue
        parts.append(f"{value:,.0f} {label}" if label == "tok/s" else f"{label} {value:.3f}")
    return " | ".join(parts)


def best_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Best wall time of `fn()` (its result waited for) over `repeats` runs, after one untimed run (its compile)."""
    import jax

    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def matmul_peak_gflops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """Best GFLOP/s of a jitted [n, n] @ [n, n] in `dtype` on the default device (1-2 s on a 2-core CPU
    at float32): the yardstick that tells a slow machine from a slow program, printed beside
    throughput figures. On accelerators use n = 8192 and the compute dtype (an H200 does about 80
    TFLOP/s in float32 at 2048, about 700 in bf16 at 8192)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def _import_summary_writer():
    """tensorboardX's writer imports torch whenever it is installed (1-2 s and an extra thread pool
    in a JAX process); when torch is not already loaded, hide it while tensorboardX imports."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` fail fast
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


def _default_enabled() -> bool:
    if "jax" not in sys.modules:
        return True
    import jax

    return jax.process_index() == 0


class MetricsLogger:
    """Writes metrics to ``run_dir/metrics.jsonl`` and TensorBoard event files in ``run_dir``.

    Args:
      run_dir: directory for the files (created).
      enabled: write files; default True on process 0 and False on the others (jax.process_index).
        progress_line works either way.
      total_steps: for step/total and the ETA.
      start_step: step this process starts at (non-zero when resuming), for the ETA rate.
      tensorboard: also write TensorBoard scalars.
      wandb: keyword arguments of wandb_sink.WandbSink (project, entity, name, mode, config, log) to also log the
        numbers to Weights & Biases; None: not.
      clock: seconds of a monotonic clock (default time.monotonic; tests pass a synthetic one).
    """

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool | None = None,
                 total_steps: int | None = None, start_step: int = 0,
                 tensorboard: bool = True, clock: Callable[[], float] = time.monotonic,
                 wandb: Mapping[str, Any] | None = None) -> None:
        self.run_dir = os.fspath(run_dir)  # local, file:// or an object store (areal_jax.paths)
        self.enabled = _default_enabled() if enabled is None else bool(enabled)
        self.total_steps = total_steps
        self.start_step = start_step
        self._clock = clock
        self._t0 = self._rate_t0 = clock()
        self._first: tuple[int, float] | None = None  # (step, time) of the first step after mark_loop_start
        self._lock = threading.Lock()
        self._jsonl = None
        self._tb = None
        self._tb_dir = None
        self._wandb = None
        if self.enabled:
            paths.makedirs(self.run_dir)
            self._jsonl = paths.AppendFile(paths.join(self.run_dir, "metrics.jsonl"))
            if tensorboard:  # event files in a node-local mirror when run_dir is an object store
                self._tb_dir = paths.MirroredDir(self.run_dir)
                self._tb = _import_summary_writer()(logdir=self._tb_dir.local, flush_secs=10)
            if wandb:
                from areal_jax.wandb_sink import WandbSink

                self._wandb = WandbSink(self.run_dir, **wandb)

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    def mark_loop_start(self, step: int) -> None:
        """The training loop starts (or resumes) at ``step`` now: the ETA's time per step counts from
        here, so start-up, evaluation and the steps of an earlier process do not skew it."""
        self.start_step = int(step)
        self._rate_t0 = self._clock()
        self._first = None

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record one set of metrics at ``step``; nested dicts become "outer/inner" names.

        Returns the flattened record written to metrics.jsonl: ``step``, ``time`` (Unix seconds),
        ``elapsed_s`` and the metrics (non-finite floats become null in JSON; TensorBoard keeps them).
        Numbers go to TensorBoard; strings and small arrays only to the JSONL file.
        """
        flat = _flatten(metrics)
        record = {"step": int(step), "time": time.time(), "elapsed_s": self.elapsed_s, **flat}
        if not self.enabled:
            return record
        with self._lock:
            if self._jsonl is None:
                raise RuntimeError("MetricsLogger.log() after close(); create a new logger.")
            line = json.dumps({k: _json_safe(v) for k, v in record.items()}, default=str)
            self._jsonl.write(line + "\n")
            self._jsonl.flush()
            if self._tb is not None:
                for name, value in flat.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        self._tb.add_scalar(name, float(value), global_step=int(step),
                                            walltime=record["time"])
            if self._wandb is not None:
                self._wandb.log(step, flat)
        return record

    def progress_line(self, step: int, metrics: Mapping[str, Any]) -> str:
        """See ``format_progress``; elapsed time counts from this logger's creation. The ETA's time
        per step counts from mark_loop_start; once a second step has finished, from the end of the
        first (which carries the loop's compiles)."""
        now = self._clock()
        if self._first is None and step > self.start_step:
            self._first = (step, now)
        start, t_start = self.start_step, self._rate_t0
        if self._first is not None and step > self._first[0]:
            start, t_start = self._first
        return format_progress(step, self.total_steps, self.elapsed_s, metrics,
                               start_step=start, rate_elapsed_s=now - t_start)

    def flush(self) -> None:
        """Make everything logged so far durable in run_dir (uploads on an object store)."""
        with self._lock:
            if self._jsonl is not None:
                self._jsonl.sync()
            if self._tb is not None:
                self._tb.flush()
                self._tb_dir.sync()

    def close(self) -> None:
        with self._lock:
            if self._jsonl is not None:
                self._jsonl.close()
                self._jsonl = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None
                self._tb_dir.close()
            if self._wandb is not None:
                self._wandb.close()
                self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class LogConfig(Section):
    """What a job records (the config's `log` section)."""

    section: ClassVar[str] = "log"

    every_steps: int = knob(1, "metrics (and the console line) every this many steps; 0 = never")
    tensorboard: bool = knob(True, "also write TensorBoard event files")
    timeline: bool = knob(True, "record timeline.json (spans of every thread, Perfetto / chrome://tracing)")
    timeline_max_events: int = knob(1_000_000, "kept in timeline.json (spooled to disk, ~150 bytes each); later "
                                    "ones are counted")
    console: bool = knob(True, "print a progress line per logged step")
    param_digests: bool = knob(False, "record params fingerprints per step (multi-process checks)")
    wandb_project: str = knob("", "also log the metrics to this Weights & Biases project (pip install wandb); empty: "
                              "not")
    wandb_entity: str = knob("", "W&B entity (team or user); empty: the account's default")
    wandb_name: str = knob("", "W&B run name; empty: the run directory's name")
    wandb_mode: str = knob("online", "online | offline (files under run_dir/wandb; upload later with wandb sync)",
                           choices=("online", "offline"))

    def check(self) -> None:
        require(self.every_steps >= 0, f"{self.key('every_steps')}={self.every_steps} must be >= 0.")
        require(self.timeline_max_events >= 1,
                f"{self.key('timeline_max_events')}={self.timeline_max_events} must be >= 1 (set "
                "--config.log.timeline=False to record no timeline).")
        require(self.wandb_project or not (self.wandb_entity or self.wandb_name),
                f"{self.key('wandb_entity')} / {self.key('wandb_name')} are set but {self.key('wandb_project')} is "
                "empty: give the project to log to Weights & Biases.")
        if self.wandb_project:
            import importlib.util

            require(importlib.util.find_spec("wandb") is not None,
                    f"{self.key('wandb_project')}={self.wandb_project!r} logs to Weights & Biases, which is not "
                    "installed: pip install wandb (or leave the project empty).")

    def wandb_settings(self, run_config: Mapping[str, Any], log: Callable[[str], None]) -> dict | None:
        """MetricsLogger's `wandb` argument: None when no project is set."""
        if not self.wandb_project:
            return None
        return {"project": self.wandb_project, "entity": self.wandb_entity, "name": self.wandb_name,
                "mode": self.wandb_mode, "config": run_config, "log": log}
