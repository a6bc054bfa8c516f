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
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models import logical_to_mesh_sharding


def _is_fully_addressable(tree: Any) -> bool:
    return all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree))


class ParamChannel:
    """Reshard published params onto the rollout mesh and deliver them to a consumer.

    Args:
      rollout_shardings: pytree of NamedSharding (same structure as the params) on the rollout mesh.
      train_mesh: the trainer's mesh; needed when the params are not fully addressable (many hosts).
      deliver: called as `deliver(params_on_rollout, version)`, typically `SamplerLoop.update_params`.
    """

    def __init__(
        self,
        rollout_shardings: Any,
        *,
        train_mesh: Mesh | None = None,
        deliver: Callable[[Any, int], None] | None = None,
    ):
        self.rollout_shardings = rollout_shardings
        self.train_mesh = train_mesh
        self.deliver = deliver
        self._lock = threading.Lock()
        self._latest: tuple[int, Any] | None = None
        self.publish_count = 0
        self.last_publish_s = 0.0
        self._gather = None
        self._copy = None

    @classmethod
    def for_model(cls, model_or_state: Any, rollout_mesh: Mesh, **kw: Any) -> "ParamChannel":
        """Build a channel whose rollout layout follows the model's logical axis rules."""
        return cls(logical_to_mesh_sharding(model_or_state, rollout_mesh), **kw)

    def _replicate_on_train_mesh(self, params: Any) -> Any:
        if self._gather is None:
            if self.train_mesh is None:
                raise ValueError(
                    "The published params span several processes but the ParamChannel has no train_mesh; "
                    "pass train_mesh= so it can gather them with the train mesh's collectives."
                )
            replicated = NamedSharding(self.train_mesh, PartitionSpec())
            self._gather = jax.jit(lambda p: p, out_shardings=jax.tree.map(lambda _: replicated, params))
        return self._gather(params)

    def reshard(self, params: Any) -> Any:
        """Return a copy of `params` laid out on the rollout mesh; never aliases the input buffers."""
        if not _is_fully_addressable(params):
            params = self._replicate_on_train_mesh(params)
            # Every process now holds a full replica locally; take one and copy it to the rollout slice.
            params = jax.tree.map(lambda x: x.addressable_shards[0].data, params)
        leaves = jax.tree.leaves(params)
        targets = jax.tree.leaves(self.rollout_shardings)
        if all(x.sharding.device_set == t.device_set for x, t in zip(leaves, targets)):
            # Same devices (colocated): `device_put` may hand back the source buffer for a shard even
            # with may_alias=False, and the trainer's next (donating) update would then delete the
            # sampler's params. A jitted copy always writes fresh buffers.
            if self._copy is None:
                self._copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.rollout_shardings)
            return self._copy(params)
        return jax.tree.map(lambda x, s: jax.device_put(x, s, may_alias=False), params, self.rollout_shardings)

    def publish(self, version: int, params: Any) -> Any:
        """Reshard `params` (version `version`) and deliver them; returns the rollout copy."""
        t0 = time.perf_counter()
        on_rollout = self.reshard(params)
        jax.block_until_ready(on_rollout)
        with self._lock:
            self._latest = (int(version), on_rollout)
            self.publish_count += 1
        if self.deliver is not None:
            self.deliver(on_rollout, int(version))
        self.last_publish_s = time.perf_counter() - t0
        return on_rollout

    def latest(self) -> tuple[int, Any] | None:
        """The most recent (version, params on the rollout mesh), or None before the first publish."""
        with self._lock:
            return self._latest
