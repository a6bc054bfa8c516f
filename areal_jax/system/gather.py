"""Trajectories of every process on every process: the trainer's update is one SPMD program over the
global train mesh, so each process must pack the same global batch.

`allgather_trajectories` exchanges the (small, host-side) trajectory arrays with one collective per array,
in process order; each field of `trainer.batch.Trajectory` arrives as it was sent, optional per-token
fields (token_advantages, loss_mask, routes) included.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from areal_jax.trainer.batch import Trajectory

Allgather = Callable[[np.ndarray], np.ndarray]  # [n, ...] per process -> [processes, n, ...]


def _process_allgather(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def allgather_trajectories(trajectories: Sequence[Trajectory], *, process_count: int | None = None,
                           allgather: Allgather | None = None) -> list[Trajectory]:
    """Every process's trajectories, concatenated in process order (identical on all processes).

    Each process must pass the same number of trajectories. With one process this is the identity.
    process_count / allgather: default jax.process_count() and JAX's process_allgather (tests pass their
    own to emulate several processes in one).
    """
    trajectories = list(trajectories)
    process_count = jax.process_count() if process_count is None else process_count
    if process_count == 1:
        return trajectories
    gather = allgather or _process_allgather
    n = len(trajectories)
    counts = gather(np.array([n], np.int32)).reshape(-1)
    if len(set(counts.tolist())) != 1:
        raise RuntimeError(f"processes hold different numbers of trajectories: {counts.tolist()}")
    lengths = np.array([len(t.tokens) for t in trajectories], np.int32)
    max_len = int(gather(np.array([lengths.max(initial=1)], np.int32)).max())
    tokens = np.zeros((n, max_len), np.int32)
    behav = np.zeros((n, max_len), np.float32)
    versions = np.zeros((n, max_len), np.int32)
    token_adv = np.zeros((n, max_len), np.float32)
    loss_mask = np.zeros((n, max_len), np.float32)
    # length, prompt_len, advantage, reward, has token_advantages, has loss_mask
    scalars = np.zeros((n, 6), np.float64)
    for i, t in enumerate(trajectories):
        c = len(t.tokens) - t.prompt_len
        tokens[i, : len(t.tokens)] = t.tokens
        behav[i, :c] = t.behav_logp
        versions[i, :c] = t.versions
        if t.token_advantages is not None:
            token_adv[i, :c] = t.token_advantages
        if t.loss_mask is not None:
            loss_mask[i, :c] = t.loss_mask
        scalars[i] = (len(t.tokens), t.prompt_len, t.advantage, t.reward, t.token_advantages is not None,
                      t.loss_mask is not None)
    g = [gather(x) for x in (tokens, behav, versions, token_adv, loss_mask, scalars)]
    g_tokens, g_behav, g_versions, g_adv, g_mask, g_scalars = g
    g_routes = None  # the sampler's experts (train.router_replay): every process records them or none does
    shaped = [t.routes for t in trajectories if t.routes is not None]
    if shaped:
        routes = np.zeros((n, max_len, *shaped[0].shape[1:]), shaped[0].dtype)
        for i, t in enumerate(trajectories):
            routes[i, : len(t.tokens)] = t.routes
        g_routes = gather(routes)
    out = []
    for p in range(g_tokens.shape[0]):
        for i in range(n):
            length, prompt_len = int(g_scalars[p, i, 0]), int(g_scalars[p, i, 1])
            c = length - prompt_len
            out.append(Trajectory(
                tokens=g_tokens[p, i, :length].copy(), prompt_len=prompt_len,
                behav_logp=g_behav[p, i, :c].copy(), versions=g_versions[p, i, :c].copy(),
                advantage=float(g_scalars[p, i, 2]), reward=float(g_scalars[p, i, 3]),
                token_advantages=g_adv[p, i, :c].copy() if g_scalars[p, i, 4] else None,
                loss_mask=g_mask[p, i, :c].copy() if g_scalars[p, i, 5] else None,
                routes=None if g_routes is None else g_routes[p, i, :length].copy(),
            ))
    return out
