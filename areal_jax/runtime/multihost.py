"""What the run loop needs to span several processes.

- Each process generates `batch_groups / process_count` groups per step from its own prompt shard and
  its own sampler (`local_batch_groups`); system.gather then gives every process the same global batch.
- `agreed_limit` makes every process plan device memory against the same limit (the smallest any reports),
  so a plan that does not fit stops every process with the same error instead of one while the others wait
  in a collective.
- `params_digest` fingerprints a params pytree (exact bytes), so processes can record and compare what
  their trainer and rollout slices hold after each publish.
"""
from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np


def local_batch_groups(batch_groups: int, process_count: int) -> int:
    """Groups each process contributes per update; B must split evenly over the processes."""
    if batch_groups % process_count:
        raise ValueError(
            f"train.batch_groups={batch_groups} does not split evenly over {process_count} processes; "
            f"use a multiple of {process_count}."
        )
    return batch_groups // process_count


def params_digest(params: Any) -> str:
    """sha256 over every leaf's bytes (fully addressable arrays: e.g. a rollout copy), in tree order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        h.update(np.ascontiguousarray(np.asarray(jax.device_get(leaf))).tobytes())
    return h.hexdigest()[:16]


def combine_limits(limits: Any) -> int | None:
    """The smallest of the processes' device memory limits (-1: a process whose devices report none, as
    CPUs do); None when any reports none."""
    values = [int(v) for v in np.asarray(limits).reshape(-1)]
    return None if not values or min(values) < 0 else min(values)


def agreed_limit(local: int | None) -> int | None:
    """`combine_limits` over every process of the run (a collective: every process must call it); `local`
    itself in a single-process run."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return combine_limits(multihost_utils.process_allgather(np.int64(-1 if local is None else local)))
