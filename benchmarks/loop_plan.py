"""The loop benchmark's memory plan: the job's own plan (`system.memory.JobMemory`, what the job checks before it
loads anything) for the benchmark's flags, printed per slice; with --plan-only also whether it fits, and nothing
else runs (`benchmarks/loop.py --plan-only [--device_memory_gib G]`)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax

HINT = " (Here --slots is rollout.num_slots and --cap sets rollout.max_len.)"


def job_plan(args: Any, cfg: Any, config: Any, device_stats: dict | None, device_kind: str) -> dict:
    """The plan of the job `config` builds (model config `cfg`) against --device_memory_gib, else the device's
    reported limit. With args.plan_only: the report (printed, its last line JSON; fits False with the error where
    the plan does not fit); on accelerators the update's and the sampler's working memory is measured too, as the
    job does. Otherwise {"memory": the JobMemory, ...the same parts}, and a plan that does not fit exits."""
    from areal_jax.config import from_config_dict
    from areal_jax.knobs import ConfigError
    from areal_jax.runtime.mesh import build_meshes
    from areal_jax.system.memory import GiB, JobMemory

    job = from_config_dict(config)
    limit = (device_stats or {}).get("bytes_limit")
    if args.device_memory_gib is not None:
        limit = int(args.device_memory_gib * GiB)
    measured = jax.default_backend() != "cpu"  # XLA:CPU's analysis of the programs does not stand for a GPU's
    base = {"benchmark": "loop", "plan_only": True, "preset": args.model or args.preset, "device": device_kind,
            "memory_limit_bytes": limit}
    try:
        meshes = build_meshes(job.mesh)
        memory = JobMemory.prepare(job, dataclasses.replace(cfg, param_dtype=job.model.storage_dtype), meshes, limit)
        if args.plan_only and measured:
            memory.resolve_update(job.train, meshes.train_mesh)
            memory.resolve_rollout(job, meshes.rollout_mesh)
    except ConfigError as e:
        if not args.plan_only:
            raise SystemExit(f"{e}{HINT}") from None
        print(f"does not fit: {e}{HINT}", flush=True)
        report = {**base, "fits": False, "error": str(e)}
        print(json.dumps(report))
        return report
    parts = {**memory.train, **memory.rollout}  # each on its own slice's devices (both on one when colocated)
    sides = {"train": memory.train, "rollout": memory.rollout}  # per device of each slice
    listed = lambda d: ", ".join(f"{k} {v / GiB:.2f}" for k, v in d.items())  # noqa: E731
    print("memory plan (GiB per device): " + (listed(parts) if memory.colocated else
                                              "; ".join(f"{k} slice: {listed(v)}" for k, v in sides.items()))
          + f"; {memory.n_params / 1e6:.1f}M params", flush=True)
    if not args.plan_only:
        return {"memory": memory, "memory_limit_bytes": limit, "memory_plan_bytes": parts, "memory_sides_bytes": sides}
    of = f" of {limit / GiB:.1f} GiB" if limit else " (no limit given or reported: nothing checked)"
    print(f"the most loaded device: {memory.plan.total / GiB:.2f} GiB{of}; "
          f"{'colocated' if memory.colocated else 'train and rollout on their own devices'}", flush=True)
    if not measured:
        print("resident parts only: XLA:CPU's memory analysis of the update and the sampler's programs does not reflect "
              "an accelerator's (every train.remat comes out the same there, and bf16 dots are widened to float32), so "
              "the working memory is measured on the accelerator itself", flush=True)
    report = {**base, "n_params": memory.n_params, "memory_plan_bytes": parts, "memory_sides_bytes": sides,
              "memory_total_bytes": memory.plan.total, "fits": True, "colocated": memory.colocated,
              "working_memory_measured": measured,
              "settings": {k: getattr(args, k) for k in ("cap", "slots", "micro_batch_tokens", "sampler_dtype", "dtype")}}
    print(json.dumps(report))
    return report
