"""Data-parallel rollout: one sampler per replica of the rollout mesh.

A rollout mesh of shape (replicas, tensor) (`runtime.mesh`, `mesh.rollout_tensor` smaller than the rollout
devices) runs one Engine and one SamplerLoop per row, each with a whole copy of the weights over that row's tensor
devices, its own slots, KV cache and requests. The alternative, one engine over the whole mesh, would split the
weights over more devices but make every device decode every slot and gather weights every step; for a model that
fits on `tensor` devices, replicas do R times the work of one engine with no cross-replica traffic at all.

`SamplerReplicas` offers the calls of one SamplerLoop (`system.interfaces.ManagedSampler`, plus pause, resume,
abort, num_pending): a request (a whole group of n samples) goes to the replica with the fewest samples pending,
completions come back from every replica, and new weights go to all of them.

Weights reach the replicas without a copy: the ParamChannel lays them out on the whole rollout mesh replicated
over "replica" (no logical axis maps to it), and `split_replicas` wraps each row's device buffers as arrays on that
row's mesh.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Hashable, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from areal_jax.models.flat_params import FlatParams
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.loop import SamplerLoop
from areal_jax.sampler.requests import Completion, Request

SEED_STRIDE = 1_000_003  # replica i samples with seed + i * SEED_STRIDE


def _view(x: jax.Array, mesh: Mesh) -> jax.Array | None:
    """x's buffers on `mesh`'s devices as an array on `mesh` (same spec), or None when x is not laid out on a mesh
    that holds a whole copy on those devices."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding) or "replica" in jax.tree.leaves(tuple(sharding.spec)):
        return None
    by_device = {s.device: s.data for s in x.addressable_shards}
    if not set(mesh.devices.flat) <= set(by_device) or sharding.mesh.axis_names != mesh.axis_names:
        return None
    target = NamedSharding(mesh, sharding.spec)
    return jax.make_array_from_single_device_arrays(x.shape, target, [by_device[d] for d in mesh.devices.flat])


def split_replicas(params: nnx.State | FlatParams, meshes: Sequence[Mesh]) -> list[FlatParams]:
    """Each replica's params: leaves laid out on the whole rollout mesh (replicated over "replica") are re-wrapped
    on each replica's mesh with no copy; any other leaf is passed as it is (the replica's engine then moves it:
    `Engine.place_params`)."""
    flat = FlatParams.of(params)
    out = []
    for mesh in meshes:
        leaves = []
        for x in flat.leaves:
            view = _view(x, mesh) if isinstance(x, jax.Array) and mesh is not None else None
            leaves.append(x if view is None else view)
        out.append(flat.replace_leaves(leaves))
    return out


class SamplerReplicas:
    """One SamplerLoop per engine (each on its own replica mesh), served as one sampler (see the module docstring).

    Args:
      engines: one Engine (or PagedEngine) per replica, each on its own devices (`runtime.mesh.replica_meshes`).
      params: the weights, on the whole rollout mesh (`split_replicas`) or anywhere the engines can take them from.
      seed: replica i samples with seed + i * SEED_STRIDE.
      timeline: replica 0 records on the "sampler" lane, replica i > 0 on "sampler.i".
      loop_kwargs: the remaining SamplerLoop arguments (version, on_update, decode_steps, fetch_behind).
    """

    def __init__(self, engines: Sequence[Engine], params: nnx.State | FlatParams, *, seed: int = 0,
                 timeline: Any = None, **loop_kwargs: Any) -> None:
        if not engines:
            raise ValueError("SamplerReplicas needs at least one engine.")
        self._cond = threading.Condition()  # guards _emitted, _owner, _left, _next; never held while taking a loop's
        self._emitted = 0
        self._owner: dict[Hashable, int] = {}  # request id -> replica serving it
        self._left: dict[Hashable, int] = {}  # request id -> samples not yet handed back
        self._next = 0  # the replica polled first by the next get_completion (round robin)
        self.loops: list[SamplerLoop] = []
        try:
            for i, (engine, p) in enumerate(zip(engines, split_replicas(params, [e.mesh for e in engines]))):
                self.loops.append(SamplerLoop(engine, p, seed=seed + i * SEED_STRIDE, timeline=timeline,
                                              lane="sampler" if i == 0 else f"sampler.{i}", on_emit=self._notify,
                                              **loop_kwargs))
        except BaseException:
            for loop in self.loops:
                loop.stop(graceful=False)
            raise

    def _notify(self) -> None:  # from a loop's thread, holding that loop's lock; never takes a loop's lock
        with self._cond:
            self._emitted += 1
            self._cond.notify_all()

    @property
    def replicas(self) -> int:
        return len(self.loops)

    @property
    def engines(self) -> list[Engine]:
        return [loop.engine for loop in self.loops]

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> None:
        """Queue ``request`` (all its n samples) on the replica with the fewest samples pending."""
        with self._cond:
            i = self._owner.get(request.id)
        if i is None:  # a loop's lock is never taken under ours (a loop's thread takes ours under its own: _notify)
            pending = [loop.num_pending() for loop in self.loops]
            i = min(range(len(pending)), key=lambda j: (pending[j], j))
        with self._cond:
            i = self._owner.setdefault(request.id, i)
            self._left[request.id] = self._left.get(request.id, 0) + int(request.n)
        self.loops[i].submit(request)

    def _handed_back(self, completion: Completion) -> None:
        with self._cond:
            left = self._left.get(completion.request_id, 0) - 1
            if left > 0:
                self._left[completion.request_id] = left
            else:
                self._left.pop(completion.request_id, None)
                self._owner.pop(completion.request_id, None)

    def get_completion(self, timeout: float | None = None) -> Completion | None:
        """The next finished sample of any replica, waiting up to ``timeout`` seconds (None: until one arrives);
        None on timeout, or once every replica has stopped and every sample was handed back."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                seen, first = self._emitted, self._next
            stopped = not any(loop.alive for loop in self.loops)  # read before the poll: nothing emitted after it
            for k in range(len(self.loops)):
                i = (first + k) % len(self.loops)
                completion = self.loops[i].get_completion(timeout=0)
                if completion is not None:
                    with self._cond:
                        self._next = (i + 1) % len(self.loops)
                    self._handed_back(completion)
                    return completion
            if stopped:
                return None
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            with self._cond:  # woken by any replica's completion; a stopped or failed loop is seen within 0.5 s
                if self._emitted == seen:
                    self._cond.wait(0.5 if remaining is None else min(remaining, 0.5))

    def abort(self, request_id: Hashable) -> None:
        """Drop a request: its queued and running samples come back as "interrupted"."""
        with self._cond:
            i = self._owner.get(request_id)
        for j, loop in enumerate(self.loops):
            if i is None or i == j:
                loop.abort(request_id)

    def num_pending(self) -> int:
        """Samples submitted and not yet handed back, over every replica."""
        return sum(loop.num_pending() for loop in self.loops)

    # ------------------------------------------------------------------ weights
    def update_params(self, params: nnx.State | FlatParams, version: int) -> None:
        """Every replica swaps in ``params`` as ``version`` at its next dispatch boundary (non-blocking)."""
        for loop, p in zip(self.loops, split_replicas(params, [loop.engine.mesh for loop in self.loops])):
            loop.update_params(p, version)

    @property
    def current_version(self) -> int:
        """The oldest version any replica decodes with now (what staleness counts against)."""
        return min(loop.current_version for loop in self.loops)

    def versioned_params(self) -> tuple[int, nnx.State]:
        """(version, params) replica 0 decodes with now, read together."""
        return self.loops[0].versioned_params()

    @property
    def params(self) -> nnx.State:
        return self.loops[0].params

    # ------------------------------------------------------------------ control
    def check(self) -> None:
        for loop in self.loops:
            loop.check()

    @property
    def alive(self) -> bool:
        return all(loop.alive for loop in self.loops)

    def pause(self) -> None:
        for loop in self.loops:
            loop.pause()

    def resume(self) -> None:
        for loop in self.loops:
            loop.resume()

    def stop(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop every replica (all told first, then joined); re-raises the first failure of any."""
        for loop in self.loops:  # the replicas wind down together
            loop.request_stop(graceful)
        errors = []
        for loop in self.loops:
            try:
                loop.stop(graceful, timeout)
            except Exception as e:  # noqa: BLE001 - every replica is joined before the first error is raised
                errors.append(e)
        if errors:
            raise errors[0]

    def stats(self) -> dict[str, float]:
        """SamplerLoop.stats summed over the replicas (mean_slot_occupancy over every replica's slot-steps,
        update_latency_s averaged over their updates, the maxima and version the extremes), plus ``replicas``."""
        each = [loop.stats() for loop in self.loops]
        out = {k: sum(s[k] for s in each) for k in each[0]}
        slot_steps = [s["steps"] * loop.engine.num_slots for s, loop in zip(each, self.loops)]
        out["mean_slot_occupancy"] = (sum(s["mean_slot_occupancy"] * n for s, n in zip(each, slot_steps))
                                      / max(1, sum(slot_steps)))
        out["update_latency_s"] = (sum(s["update_latency_s"] * s["updates"] for s in each)
                                   / max(1, sum(s["updates"] for s in each)))
        out["update_latency_max_s"] = max(s["update_latency_max_s"] for s in each)
        out["version"] = min(s["version"] for s in each)
        out["replicas"] = len(each)
        return out

    def __enter__(self) -> "SamplerReplicas":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop(graceful=False)


def make_sampler(rollout: Any, model: Any, mesh: Mesh, params: nnx.State | FlatParams, *, config: Any,
                 seed: int, **loop_kwargs: Any) -> SamplerLoop | SamplerReplicas:
    """The job's sampler: a SamplerLoop on the rollout mesh when it has one replica, else SamplerReplicas over one
    engine per replica (`rollout.make_engine`: a sampler.config.RolloutConfig)."""
    from areal_jax.runtime.mesh import replica_meshes

    meshes = replica_meshes(mesh)
    if len(meshes) == 1:
        return SamplerLoop(rollout.make_engine(model, mesh=mesh, config=config), params, seed=seed, **loop_kwargs)
    engines = [rollout.make_engine(model, mesh=m, config=config) for m in meshes]
    return SamplerReplicas(engines, params, seed=seed, **loop_kwargs)
