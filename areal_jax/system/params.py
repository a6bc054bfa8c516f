"""ParamChannel: versioned parameters from the trainer's slice to the sampler's slice.

The trainer publishes `(version, params)` after every update. The channel reshards the params onto the
rollout slice and hands them to the SamplerLoop, which swaps them in between two decode steps.

Two hazards shape the implementation:
- Donation. The trainer donates its state to the next update, which frees the buffers of the params it
  published. The sampler must therefore own a copy, never an alias, even when both slices are the same
  device (colocated): every published leaf is copied (`may_alias=False`).
- Many hosts. The train mesh spans every process while each rollout mesh is local to one process, and a
  direct cross-process `device_put` needs per-process transfer sockets. Instead the params are first
  gathered to a fully replicated layout with the train mesh's own collectives (one jitted identity with
  replicated out_shardings), after which every process holds a whole copy on its local train devices and
  copies it device-to-device onto its rollout slice.

Sampler precision: with `dtype=jnp.bfloat16` the channel hands the sampler bf16 weights cast from the
float32 train weights on the device, inside the same jitted program that copies (or gathers) them; the
cast happens before any cross-device move, so a split hand-off also moves half the bytes. Nothing goes
through the host. Integer leaves and leaves already in `dtype` are copied unchanged.

A job does better still: its trainer writes the sampler's copy inside the optimizer step that ends each
update (`Trainer.keep_sampler_copy`, trainer.publish: one more fused write, no read), and publishes it with
`owned=True`. Those buffers are fresh and never donated, so where they are already in the rollout layout
(one device, or the same mesh layout) the channel hands them over without copying; elsewhere it moves them
as it moves any params, the cast already done.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from areal_jax.models import FlatParams, logical_to_mesh_sharding
from areal_jax.models.flat_params import cast_floating, cast_leaves, cast_shapes
from areal_jax.system.interfaces import ParamsSink


def _index_key(index: tuple) -> tuple:
    return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)


def _shards_cover(x: jax.Array, target: jax.sharding.Sharding) -> bool:
    """Whether device_put(x, target) can copy each target shard from one source buffer: x is on one
    device (device_put slices it there) or holds every shard the target needs as a buffer."""
    if len(x.sharding.device_set) == 1:
        return True
    have = {_index_key(i) for i in x.sharding.devices_indices_map(x.shape).values()}
    return all(_index_key(i) in have for i in target.devices_indices_map(x.shape).values())


def tree_nbytes(tree: Any) -> int:
    """Total bytes of the arrays (or ShapeDtypeStructs) in `tree`."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


class ParamChannel:
    """Reshard published params onto the rollout mesh and deliver them to a consumer.

    Args:
      rollout_shardings: pytree of NamedSharding (same structure as the params) on the rollout mesh.
      train_mesh: the trainer's mesh; needed when the params are not fully addressable (many hosts).
      deliver: called as `deliver(params_on_rollout, version)`, typically a ManagedSampler's
        `update_params` (areal_jax.system.interfaces).
      dtype: the sampler's parameter dtype (e.g. jnp.bfloat16); floating leaves are cast on the device.
        None keeps the published dtype.
    """

    def __init__(
        self,
        rollout_shardings: nnx.State | dict[str, Any],
        *,
        train_mesh: Mesh | None = None,
        deliver: ParamsSink | None = None,
        dtype: DTypeLike | None = None,
    ):
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.train_mesh = train_mesh
        self.deliver = deliver
        self._lock = threading.Lock()
        self._latest: tuple[int, FlatParams] | None = None
        self.publish_count = 0
        self.last_publish_s = 0.0
        self._gather = None
        self._copy = None
        self._cast = None
        self._targets = jax.tree.leaves(rollout_shardings)  # the rollout shardings, flat
        self._plans: dict = {}  # (treedef, source shardings, dtypes) -> _plan's tuple
        self.last_bytes = 0  # bytes of the sampler's copy the last reshard handed over (each replica's counted)
        self.last_copied = True  # whether that reshard wrote them (False: an owned copy handed over as it was)

    @property
    def targets(self) -> list:
        """The rollout layout, one sharding per leaf of the params in their flattening order."""
        return list(self._targets)

    @classmethod
    def for_model(cls, model_or_state: nnx.Module | nnx.State, rollout_mesh: Mesh, **kw: Any) -> "ParamChannel":
        """Build a channel whose rollout layout follows the model's logical axis rules."""
        return cls(logical_to_mesh_sharding(model_or_state, rollout_mesh), **kw)

    def _replicate_on_train_mesh(self, leaves: tuple[jax.Array, ...]) -> list[jax.Array]:
        if self._gather is None:
            if self.train_mesh is None:
                raise ValueError(
                    "The published params span several processes but the ParamChannel has no train_mesh; "
                    "pass train_mesh= so it can gather them with the train mesh's collectives."
                )
            replicated = NamedSharding(self.train_mesh, PartitionSpec())
            self._gather = jax.jit(lambda xs: cast_floating(xs, self.dtype), out_shardings=[replicated] * len(leaves))
        return self._gather(list(leaves))

    def _stage(self, leaves: tuple[jax.Array, ...]) -> list[jax.Array]:
        """Cast (when `dtype` is set) and lay out the leaves on their own devices so that every shard the
        rollout layout needs already exists as one buffer; the following device_put is then one
        device-to-device copy per shard. (When the source's shard index map differs from the
        target's, device_put assembles the whole array on the host and uploads it again.) The staging
        layout is the rollout mesh's shape and specs on the first source devices, or one source
        device when the source has fewer devices than the rollout mesh."""
        targets = self._targets
        casts = self.dtype is not None and any(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != self.dtype
                                                for x in leaves)
        if not casts and all(_shards_cover(x, t) for x, t in zip(leaves, targets)):
            return list(leaves)  # device_put already copies (or slices) each shard on the device
        if not all(isinstance(t, NamedSharding) for t in targets):
            return cast_floating(list(leaves), self.dtype)
        if self._cast is None:
            rollout_mesh = targets[0].mesh
            source = sorted(set().union(*(x.sharding.device_set for x in leaves)), key=lambda d: d.id)
            if len(source) >= rollout_mesh.size:
                devices = np.array(source[: rollout_mesh.size]).reshape(rollout_mesh.devices.shape)
                mirror = Mesh(devices, rollout_mesh.axis_names, axis_types=rollout_mesh.axis_types)
                staging = [NamedSharding(mirror, t.spec) for t in targets]
            else:
                one = Mesh(np.array(source[:1]).reshape((1,) * rollout_mesh.devices.ndim), rollout_mesh.axis_names)
                staging = [NamedSharding(one, PartitionSpec())] * len(targets)
            self._cast = jax.jit(lambda xs: cast_leaves(xs, self.dtype),
                                 out_shardings=staging)
        return self._cast(list(leaves))

    def _plan(self, flat: FlatParams) -> tuple[bool, bool, int, bool]:
        """(fully addressable, colocated with the rollout shardings, bytes of the sampler's copy, already the
        copy: every leaf in the sampler's dtype and laid out as the rollout wants it), cached per tree
        structure, source shardings, shapes and dtypes (read once per FlatParams)."""
        key = (flat.treedef, flat.shardings, flat.avals)
        plan = self._plans.get(key)
        if plan is None:
            leaves = flat.leaves
            if len(leaves) != len(self._targets):
                raise ValueError(f"ParamChannel got params with {len(leaves)} leaves; its rollout shardings have "
                                 f"{len(self._targets)}. Publish the params of the model the channel was built for.")
            addressable = all(getattr(x, "is_fully_addressable", True) for x in leaves)
            colocated = all(x.sharding.device_set == t.device_set for x, t in zip(leaves, self._targets))
            written = cast_shapes(list(leaves), self.dtype)
            copies = [t.mesh.shape.get("replica", 1) if isinstance(t, NamedSharding) else 1 for t in self._targets]
            nbytes = sum(tree_nbytes(w) * c for w, c in zip(written, copies))  # a whole copy per sampler replica
            ready = addressable and all(x.dtype == w.dtype and x.sharding.is_equivalent_to(t, x.ndim)
                                        for x, w, t in zip(leaves, written, self._targets))
            plan = self._plans[key] = (addressable, colocated, nbytes, ready)
        return plan

    def reshard(self, params: nnx.State | FlatParams, *, owned: bool = False) -> FlatParams:
        """Return a copy of `params` laid out on the rollout mesh (floating leaves in `dtype` when set),
        held flat (FlatParams: `.tree()` gives the nnx.State); never aliases the input buffers and never
        moves them through the host.

        owned: `params` are fresh buffers that nothing will donate or delete (`Trainer.sampler_copy()`);
        when they are already in the sampler's dtype and layout they are handed over as they are, no copy
        made (`last_copied` False)."""
        # The params are flattened once per call and the copy is never rebuilt into an nnx.State: at a
        # few hundred leaves, each pass over an nnx.State costs about a millisecond of Python, which used
        # to be most of a colocated hand-off.
        flat = FlatParams.of(params)
        plan = self._plan(flat)
        if not plan[0]:  # spans several processes
            # Every process gathers a full replica locally; take one and copy it to the rollout slice.
            flat = flat.replace_leaves([x.addressable_shards[0].data for x in self._replicate_on_train_mesh(flat.leaves)])
            plan = self._plan(flat)
        leaves = flat.leaves
        _, colocated, self.last_bytes, ready = plan
        self.last_copied = not (owned and ready)
        if not self.last_copied:
            return flat
        if colocated:
            # Same devices: `device_put` may hand back the source buffer for a shard even with
            # may_alias=False, and the trainer's next (donating) update would then delete the sampler's
            # params. One jitted copy over the flat leaves always writes fresh buffers.
            if self._copy is None:
                self._copy = jax.jit(lambda xs: cast_leaves(xs, self.dtype),
                                     out_shardings=self._targets)
            return flat.replace_leaves(self._copy(list(leaves)))
        staged = self._stage(leaves)
        return flat.replace_leaves(jax.device_put(staged, self._targets, may_alias=False))

    def publish(self, version: int, params: nnx.State | FlatParams, *, owned: bool = False) -> FlatParams:
        """Reshard `params` (version `version`; `owned` as for reshard) and deliver them; returns the rollout
        copy."""
        t0 = time.perf_counter()
        on_rollout = self.reshard(params, owned=owned)
        jax.block_until_ready(on_rollout)
        with self._lock:
            self._latest = (int(version), on_rollout)
            self.publish_count += 1
        if self.deliver is not None:
            self.deliver(on_rollout, int(version))
        self.last_publish_s = time.perf_counter() - t0
        return on_rollout

    def latest(self) -> tuple[int, FlatParams] | None:
        """The most recent (version, params on the rollout mesh), or None before the first publish."""
        with self._lock:
            return self._latest
