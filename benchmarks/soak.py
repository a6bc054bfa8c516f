"""Soak: the tiny self-made run for many steps, watched for anything that grows without bound.

A monitor thread samples the running RLJob every --interval seconds: resident memory of the main
process and of the reward workers, threads and open file descriptors, the sampler's slot occupancy
(over the last interval), request queue and running slots, completions not yet collected, the
controller's in-flight groups, the trajectory buffer and the reward pool's backlog. It prints a table
(about 12 rows), the RSS at start / middle / end, the RSS slope over the second half, the same for
Python's own heap (allocated blocks: growth there is a leak of Python objects, whereas RSS also moves
with XLA's native allocations, e.g. a one-off compile of a new shape), and ends with one line of JSON.

    python benchmarks/soak.py --steps 500            # ~30 s of training after ~15 s of start-up, 2 CPU cores
    python benchmarks/soak.py --steps 5000 --interval 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500, help="trainer updates to run")
    p.add_argument("--eta", type=int, default=1, help="staleness bound (rollout.max_staleness)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between monitor samples")
    p.add_argument("--checkpoint-every", type=int, default=50, help="checkpoint.every_steps")
    p.add_argument("--dir", default=None, help="work directory (default: a fresh temporary one)")
    p.add_argument("--no-timeline", action="store_true", help="log.timeline=False (no trace events kept)")
    return p.parse_args(argv)


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of a process in MiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclasses.dataclass
class Sample:
    """One look at the job. Sizes are counts of groups unless named otherwise."""
    t: float
    step: int
    rss_main_mb: float
    rss_workers_mb: float
    py_blocks: int  # Python objects' memory blocks (sys.getallocatedblocks): native memory excluded
    threads: int
    open_fds: int
    sampler_steps: int
    busy_slot_steps: float
    occupancy: float  # busy slots / all slots over the interval ending here
    queue_samples: int  # sampler requests waiting for a slot, in samples
    running_slots: int
    uncollected: int  # finished completions the controller has not taken yet
    ctl_in_flight: int
    buffer_ready: int
    buffer_generating: int
    reward_pending: int


class Monitor:
    """Samples a running RLJob from a daemon thread."""

    def __init__(self, job, interval: float):
        self.job, self.interval = job, interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def take(self) -> Sample:
        job = self.job
        st = job.sampler.stats()
        busy = st["mean_slot_occupancy"] * st["steps"] * job.engine.num_slots
        prev = self.samples[-1] if self.samples else None
        d_steps = st["steps"] - (prev.sampler_steps if prev else 0)
        d_busy = busy - (prev.busy_slot_steps if prev else 0.0)
        occ = d_busy / (d_steps * job.engine.num_slots) if d_steps > 0 else 0.0
        pool = job.reward_pool.counters()
        sizes = job.buffer.sizes()
        return Sample(
            t=time.perf_counter(), step=int(job.sampler.current_version), rss_main_mb=rss_mb(),
            rss_workers_mb=sum(rss_mb(p) for p in job.reward_pool.worker_pids()),
            py_blocks=sys.getallocatedblocks(),
            threads=threading.active_count(), open_fds=len(os.listdir("/proc/self/fd")),
            sampler_steps=int(st["steps"]), busy_slot_steps=busy, occupancy=occ,
            queue_samples=int(st["queue_depth"]), running_slots=int(st["running"]),
            uncollected=len(getattr(job.sampler, "_out", ())),
            ctl_in_flight=int(job.controller.running), buffer_ready=int(sizes["buffer_ready_groups"]),
            buffer_generating=int(sizes["buffer_generating_groups"]),
            reward_pending=int(pool["pending"]) + int(pool["in_flight"]),
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self.take())


def at_step(samples: list[Sample], step: int) -> Sample:
    """The first sample taken at or after trainer step `step` (else the last one)."""
    return next((s for s in samples if s.step >= step), samples[-1])


def report(samples: list[Sample], steps: int, wall_s: float, summary: dict, config) -> dict:
    start = at_step(samples, 1)
    middle, end = at_step(samples, steps // 2), samples[-1]
    half = [s for s in samples if s.step >= steps // 2] or samples

    def per_100_steps(values: list[float]) -> float:  # least-squares slope over the second half
        if len({s.step for s in half}) < 2:
            return 0.0
        return float(np.polyfit([s.step for s in half], values, 1)[0]) * 100

    b, eta = config.train.batch_groups, config.rollout.max_staleness
    occupancy = [s.occupancy for s in samples if s.step >= 1]
    return {
        "steps": summary["steps"], "wall_s": round(wall_s, 1), "samples": len(samples),
        "rss_main_mb": {"start": round(start.rss_main_mb, 1), "middle": round(middle.rss_main_mb, 1),
                        "end": round(end.rss_main_mb, 1)},
        "rss_main_mb_per_100_steps_second_half": round(per_100_steps([s.rss_main_mb for s in half]), 2),
        "py_blocks": {"start": start.py_blocks, "middle": middle.py_blocks, "end": end.py_blocks},
        "py_blocks_per_100_steps_second_half": round(per_100_steps([float(s.py_blocks) for s in half])),
        "rss_workers_mb": {"start": round(start.rss_workers_mb, 1), "end": round(end.rss_workers_mb, 1)},
        "threads": {"start": start.threads, "end": end.threads, "max": max(s.threads for s in samples)},
        "open_fds": {"start": start.open_fds, "end": end.open_fds, "max": max(s.open_fds for s in samples)},
        "occupancy": {"mean": round(float(np.mean(occupancy)), 3) if occupancy else None,
                      "p10": round(float(np.percentile(occupancy, 10)), 3) if occupancy else None,
                      "p90": round(float(np.percentile(occupancy, 90)), 3) if occupancy else None},
        "max": {"queue_samples": max(s.queue_samples for s in samples),
                "uncollected": max(s.uncollected for s in samples),
                "ctl_in_flight": max(s.ctl_in_flight for s in samples),
                "buffer_ready": max(s.buffer_ready for s in samples),
                "buffer_generating": max(s.buffer_generating for s in samples),
                "reward_pending": max(s.reward_pending for s in samples)},
        # Admission keeps accepted + running below (eta + v + 1) * B: at most (eta + 1) * B groups are
        # ahead of the trainer at any time.
        "admission_bound_groups": (eta + 1) * b if eta is not None else None,
        "tokens_per_s": summary.get("tokens_per_s"), "staleness_max": summary.get("staleness_max"),
    }


def print_table(samples: list[Sample], rows: int = 12) -> None:
    picks = [samples[int(i)] for i in np.linspace(0, len(samples) - 1, min(rows, len(samples)))]
    t0 = samples[0].t
    print(f"{'t_s':>6} {'step':>5} {'rss_mb':>7} {'workers_mb':>10} {'thr':>4} {'fds':>4} {'occ':>5} "
          f"{'queue':>5} {'run':>4} {'uncol':>5} {'ctl':>4} {'ready':>5} {'gen':>4} {'rwd':>4}")
    for s in picks:
        print(f"{s.t - t0:6.1f} {s.step:5d} {s.rss_main_mb:7.1f} {s.rss_workers_mb:10.1f} {s.threads:4d} "
              f"{s.open_fds:4d} {s.occupancy:5.2f} {s.queue_samples:5d} {s.running_slots:4d} {s.uncollected:5d} "
              f"{s.ctl_in_flight:4d} {s.buffer_ready:5d} {s.buffer_generating:4d} {s.reward_pending:4d}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from areal_jax.main import enable_compilation_cache
    from areal_jax.system.job import RLJob
    from areal_jax.system.tiny import tiny_config

    enable_compilation_cache()
    work = args.dir or tempfile.mkdtemp(prefix="areal_soak_")
    config = tiny_config(os.path.join(work, "assets"), run_dir=os.path.join(work, "run"), eta=args.eta,
                         steps=args.steps)
    config.checkpoint.every_steps = args.checkpoint_every
    config.checkpoint.resume = False
    config.log.tensorboard = False
    config.log.timeline = not args.no_timeline
    job = RLJob(config, log_fn=lambda *a, **k: None)
    monitor = Monitor(job, args.interval).start()
    t0 = time.perf_counter()
    try:
        summary = job.run()
    finally:
        wall = time.perf_counter() - t0
        monitor.samples.append(monitor.take())
        monitor.stop()
        job.close()
    print_table(monitor.samples)
    out = report(monitor.samples, args.steps, wall, summary, config)
    r = out["rss_main_mb"]
    print(f"RSS main process: start {r['start']} MiB, middle {r['middle']} MiB, end {r['end']} MiB "
          f"({out['rss_main_mb_per_100_steps_second_half']:+.2f} MiB per 100 steps over the second half); "
          f"{out['steps']} steps in {out['wall_s']} s, occupancy mean {out['occupancy']['mean']}")
    b = out["py_blocks"]
    print(f"Python heap blocks: start {b['start']}, middle {b['middle']}, end {b['end']} "
          f"({out['py_blocks_per_100_steps_second_half']:+d} per 100 steps over the second half)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
