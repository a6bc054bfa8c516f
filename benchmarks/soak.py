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
import gc
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


LOWERINGS = [0]
LOWERED_NAMES: list[str] = []  # in order, to name what was lowered late


def _count_lowering(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        LOWERINGS[0] += 1
        LOWERED_NAMES.append(str(kwargs.get("fun_name", "?")))


@dataclasses.dataclass
class Sample:
    """One look at the job. Sizes are counts of groups unless named otherwise."""
    t: float
    step: int
    rss_main_mb: float
    rss_workers_mb: float
    py_blocks: int  # Python objects' memory blocks (sys.getallocatedblocks): native memory excluded
    lowerings: int  # jitted programs lowered so far (a new shape: one-off Python objects for its caches)
    py_blocks_collected: int | None  # py_blocks right after gc.collect(), at every twentieth of the run
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

    def __init__(self, job, interval: float, collect_every_steps: int = 0):
        self.job, self.interval = job, interval
        self.collect_every = collect_every_steps
        self._next_collect = 0
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _collected_blocks(self, step: int, final: bool) -> int | None:
        if not final and (not self.collect_every or step < self._next_collect):
            return None
        self._next_collect = (step // max(self.collect_every, 1) + 1) * max(self.collect_every, 1)
        gc.collect()
        return sys.getallocatedblocks()

    def take(self, final: bool = False) -> Sample:
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
            py_blocks=sys.getallocatedblocks(), lowerings=LOWERINGS[0],
            py_blocks_collected=self._collected_blocks(int(job.sampler.current_version), final),
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

    collected = [s for s in samples if s.py_blocks_collected is not None]
    collected_rate, covered = heap_growth_between_lowerings([s for s in collected if s.step >= steps // 2])
    b, eta = config.train.batch_groups, config.rollout.max_staleness
    occupancy = [s.occupancy for s in samples if s.step >= 1]
    return {
        "steps": summary["steps"], "wall_s": round(wall_s, 1), "samples": len(samples),
        "rss_main_mb": {"start": round(start.rss_main_mb, 1), "middle": round(middle.rss_main_mb, 1),
                        "end": round(end.rss_main_mb, 1)},
        "rss_main_mb_per_100_steps_second_half": round(per_100_steps([s.rss_main_mb for s in half]), 2),
        "py_blocks": {"start": start.py_blocks, "middle": middle.py_blocks, "end": end.py_blocks},
        "py_blocks_per_100_steps_second_half": round(per_100_steps([float(s.py_blocks) for s in half])),
        "py_blocks_collected": {str(s.step): s.py_blocks_collected for s in collected},
        "py_blocks_collected_per_100_steps_second_half": collected_rate,
        "py_blocks_collected_steps_covered": covered,
        "lowerings": {"start": start.lowerings, "middle": middle.lowerings, "end": end.lowerings},
        "lowered_second_half": sorted(set(LOWERED_NAMES[middle.lowerings:end.lowerings])),
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


def heap_growth_between_lowerings(samples: list[Sample]) -> tuple[int | None, int]:
    """Python heap growth per 100 steps, from heap sizes taken after a full garbage collection.

    Collected sizes leave out the collector's own sawtooth (cyclic garbage waits for a generation-2
    pass). A jitted function met with a new shape (a packing bucket first used late) adds Python
    objects once, for its caches, which in a short run on a cold compile cache looks like growth. So
    the samples are cut into segments at each lowering of a new program, and the rate is the pooled
    least-squares slope within the segments (each segment keeps its own level): what grows with the
    number of steps, not the one-off steps. Returns (rate or None, steps covered by the segments).
    """
    segments: list[list[Sample]] = []
    for s in samples:
        if segments and segments[-1][-1].lowerings == s.lowerings:
            segments[-1].append(s)
        else:
            segments.append([s])
    sxy = sxx = 0.0
    covered = 0
    for seg in segments:
        if len(seg) < 2:
            continue
        x = np.array([s.step for s in seg], float)
        y = np.array([s.py_blocks_collected for s in seg], float)
        sxy += float(((x - x.mean()) * (y - y.mean())).sum())
        sxx += float(((x - x.mean()) ** 2).sum())
        covered += int(x[-1] - x[0])
    return (round(100 * sxy / sxx) if sxx > 0 else None), covered


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
    import jax

    from areal_jax.programs.rl import enable_compilation_cache
    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config

    enable_compilation_cache()
    jax.monitoring.register_event_duration_secs_listener(_count_lowering)
    work = args.dir or tempfile.mkdtemp(prefix="areal_soak_")
    config = tiny_config(os.path.join(work, "assets"), run_dir=os.path.join(work, "run"), eta=args.eta,
                         steps=args.steps)
    config.checkpoint.every_steps = args.checkpoint_every
    config.checkpoint.resume = False
    config.log.tensorboard = False
    config.log.timeline = not args.no_timeline
    job = RLJob(config, log_fn=lambda *a, **k: None)
    monitor = Monitor(job, args.interval, collect_every_steps=max(1, args.steps // 20)).start()
    t0 = time.perf_counter()
    try:
        summary = job.run()
    finally:
        wall = time.perf_counter() - t0
        monitor.samples.append(monitor.take(final=True))
        monitor.stop()
        job.close()
    # After close every thread and file of the job must be gone (during the run, background writers
    # such as the timeline spool or the metrics log hold a file open for a moment now and then).
    closed = {"threads": threading.active_count(), "open_fds": len(os.listdir("/proc/self/fd"))}
    print_table(monitor.samples)
    out = report(monitor.samples, args.steps, wall, summary, config)
    out["threads"]["closed"], out["open_fds"]["closed"] = closed["threads"], closed["open_fds"]
    r = out["rss_main_mb"]
    print(f"RSS main process: start {r['start']} MiB, middle {r['middle']} MiB, end {r['end']} MiB "
          f"({out['rss_main_mb_per_100_steps_second_half']:+.2f} MiB per 100 steps over the second half); "
          f"{out['steps']} steps in {out['wall_s']} s, occupancy mean {out['occupancy']['mean']}")
    b = out["py_blocks"]
    print(f"Python heap blocks: start {b['start']}, middle {b['middle']}, end {b['end']} "
          f"({out['py_blocks_per_100_steps_second_half']:+d} per 100 steps over the second half); after a full "
          f"collection: {out['py_blocks_collected']} by step, "
          f"{out['py_blocks_collected_per_100_steps_second_half']} per 100 steps over the second half "
          f"(over the {out['py_blocks_collected_steps_covered']} steps in which no new program was lowered); "
          f"{out['lowerings']['end'] - out['lowerings']['middle']} programs lowered in the second half "
          f"{out['lowered_second_half']}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
