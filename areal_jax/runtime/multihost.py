"""What the run loop needs to span several processes.

- Each process generates `batch_groups / process_count` groups per step from its own prompt shard and
  its own sampler; the trainer's update is one SPMD program over the global train mesh, fed the same
  global batch on every process: `allgather_trajectories` exchanges the (small, host-side) trajectory
  arrays with one collective, in process order, so every process packs identical micro-batches.
- `params_digest` fingerprints a params pytree (exact bytes), so processes can record and compare what
  their trainer and rollout slices hold after each publish.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

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


def allgather_trajectories(trajectories: Sequence[Any]) -> list:
    """Every process's trajectories, concatenated in process order (identical on all processes).

    Each process must pass the same number of trajectories. With one process this is the identity.
    """
    from jax.experimental import multihost_utils

    from areal_jax.trainer.batch import Trajectory

    trajectories = list(trajectories)
    if jax.process_count() == 1:
        return trajectories
    n = len(trajectories)
    counts = multihost_utils.process_allgather(np.array([n], np.int32))
    if len(set(counts.reshape(-1).tolist())) != 1:
        raise RuntimeError(f"processes hold different numbers of trajectories: {counts.reshape(-1).tolist()}")
    lengths = np.array([len(t.tokens) for t in trajectories], np.int32)
    max_len = int(multihost_utils.process_allgather(np.array([lengths.max(initial=1)], np.int32)).max())
    tokens = np.zeros((n, max_len), np.int32)
    behav = np.zeros((n, max_len), np.float32)
    versions = np.zeros((n, max_len), np.int32)
    scalars = np.zeros((n, 4), np.float64)  # length, prompt_len, advantage, reward
    for i, t in enumerate(trajectories):
        c = len(t.tokens) - t.prompt_len
        tokens[i, : len(t.tokens)] = t.tokens
        behav[i, :c] = t.behav_logp
        versions[i, :c] = t.versions
        scalars[i] = (len(t.tokens), t.prompt_len, t.advantage, t.reward)
    g_tokens, g_behav, g_versions, g_scalars = (
        np.asarray(multihost_utils.process_allgather(x)) for x in (tokens, behav, versions, scalars)
    )
    out = []
    for p in range(g_tokens.shape[0]):
        for i in range(n):
            length, prompt_len = int(g_scalars[p, i, 0]), int(g_scalars[p, i, 1])
            c = length - prompt_len
            out.append(Trajectory(
                tokens=g_tokens[p, i, :length].copy(), prompt_len=prompt_len,
                behav_logp=g_behav[p, i, :c].copy(), versions=g_versions[p, i, :c].copy(),
                advantage=float(g_scalars[p, i, 2]), reward=float(g_scalars[p, i, 3]),
            ))
    return out


def params_digest(params: Any) -> str:
    """sha256 over every leaf's bytes (fully addressable arrays: e.g. a rollout copy), in tree order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        h.update(np.ascontiguousarray(np.asarray(jax.device_get(leaf))).tobytes())
    return h.hexdigest()[:16]
