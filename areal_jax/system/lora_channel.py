"""AdapterChannel: the LoRA hand-off. The frozen base crosses to the rollout slice once; every later
publish moves only the adapters (A and B of each adapted projection) and rebuilds the sampler's weights
there.

Two sampler forms (`mode`):
- "merged": on the rollout slice, one jitted program folds the adapters into a fresh copy of the base,
  W' = W + (alpha / r) * A @ B, in the sampler's dtype (bf16 on accelerators), and the sampler decodes the
  plain decoder graph (`lora.plain_graphdef`). The rollout slice holds the base plus one merged copy.
- "unmerged": the sampler decodes the adapted graph with dropout off; each projection adds
  x @ A @ B beside x @ W. Nothing is rebuilt; the rollout slice holds the base and the adapters only.

It offers the same calls as `ParamChannel` (reshard, publish, latest, deliver, publish_count,
last_publish_s) plus `last_bytes` (bytes that crossed in the last reshard) and `base_bytes`.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.typing import DTypeLike

from areal_jax.models import logical_to_mesh_sharding, lora
from areal_jax.system.interfaces import ParamsSink
from areal_jax.system.params import ParamChannel

MODES = ("merged", "unmerged")


def split_adapters(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapters, frozen rest) of an adapted model's state."""
    adapters, rest = nnx.split_state(params, nnx.LoRAParam, ...)
    return adapters, rest


def sampler_graphdef(model: nnx.Module, mode: str) -> nnx.GraphDef:
    """The graph the sampler decodes with: the plain decoder ("merged") or the adapted one, dropout off."""
    return lora.plain_graphdef(model.cfg) if mode == "merged" else lora.sampler_graphdef(model)


def tree_bytes(tree: Any) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


class AdapterChannel:
    """Publish an adapted model's params to the rollout slice, moving only the adapters after the first time.

    Args:
      params: the adapted model's full state (`Trainer.params`: adapters and frozen base); the base is
        copied to the rollout mesh here, once.
      rollout_mesh: the sampler's mesh.
      scale: alpha / rank of the adapters.
      mode: "merged" or "unmerged" (see the module docstring).
      dtype: dtype of the merged weights ("merged" mode; default: the base's).
      train_mesh, deliver: as for `ParamChannel`.
    """

    def __init__(self, params: nnx.State, rollout_mesh: Mesh, *, scale: float, mode: str = "merged",
                 dtype: DTypeLike | None = None, train_mesh: Mesh | None = None,
                 deliver: ParamsSink | None = None):
        if mode not in MODES:
            raise ValueError(f"lora.sampler={mode!r} is not one of {', '.join(MODES)}.")
        adapters, base = split_adapters(params)
        if not jax.tree.leaves(adapters):
            raise ValueError("AdapterChannel needs an adapted model's params (models.lora.apply_lora); use "
                             "ParamChannel for plain models.")
        self.mode, self.scale, self.dtype = mode, float(scale), dtype
        self.deliver = deliver
        self._adapters = ParamChannel(logical_to_mesh_sharding(adapters, rollout_mesh), train_mesh=train_mesh)
        self.base = ParamChannel(logical_to_mesh_sharding(base, rollout_mesh), train_mesh=train_mesh).reshard(base).tree()
        self.base_bytes = tree_bytes(self.base)
        self._merge = None
        if mode == "merged":
            merged_shape = jax.eval_shape(lambda b, a: lora.merge_state(nnx.merge_state(b, a), self.scale, dtype),
                                          self.base, adapters)
            self._merge = jax.jit(lambda b, a: lora.merge_state(nnx.merge_state(b, a), self.scale, dtype),
                                  out_shardings=logical_to_mesh_sharding(merged_shape, rollout_mesh))
        self._lock = threading.Lock()
        self._latest: tuple[int, nnx.State] | None = None
        self.publish_count = 0
        self.last_publish_s = 0.0
        self.last_bytes = 0

    def reshard(self, params: nnx.State) -> nnx.State:
        """The sampler's params for `params` (a full adapted state, or the adapters alone): only the
        adapters are copied to the rollout slice; never aliases the input buffers."""
        adapters, _ = split_adapters(params)
        on_rollout = self._adapters.reshard(adapters).tree()
        self.last_bytes = tree_bytes(on_rollout)
        if self._merge is not None:
            return self._merge(self.base, on_rollout)
        return nnx.merge_state(self.base, on_rollout)

    def publish(self, version: int, params: nnx.State) -> nnx.State:
        """Hand `params` (version `version`) to the rollout slice and deliver them; returns the sampler's copy."""
        t0 = time.perf_counter()
        out = self.reshard(params)
        jax.block_until_ready(out)
        with self._lock:
            self._latest = (int(version), out)
            self.publish_count += 1
        if self.deliver is not None:
            self.deliver(out, int(version))
        self.last_publish_s = time.perf_counter() - t0
        return out

    def latest(self) -> tuple[int, nnx.State] | None:
        """The most recent (version, sampler params), or None before the first publish."""
        with self._lock:
            return self._latest
