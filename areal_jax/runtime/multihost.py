"""What the run loop needs to span several processes.

- Each process generates `batch_groups / process_count` groups per step from its own prompt shard and
  its own sampler (`local_batch_groups`); system.gather then gives every process the same global batch.
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
