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

from areal_jax.models import FlatParams, as_tree, logical_to_mesh_sharding, lora
from areal_jax.models.flat_params import merge_order, merged_flat
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
        adapters = FlatParams.of(adapters)
        self._adapter_def, self._adapter_bytes = adapters.treedef, tree_bytes(adapters)
        self._adapters = ParamChannel(logical_to_mesh_sharding(adapters.tree(), rollout_mesh), train_mesh=train_mesh)
        self._base = ParamChannel(logical_to_mesh_sharding(base, rollout_mesh), train_mesh=train_mesh).reshard(base)
        self.base = self._base.tree()
        self.base_bytes = tree_bytes(self._base)
        # Everything below works on flat leaves (models.FlatParams): each pass over an nnx.State of a few hundred
        # leaves costs about a millisecond of Python, which was most of a hand-off's time.
        if mode == "merged":
            def merge(b: FlatParams, a: FlatParams) -> nnx.State:
                return lora.merge_state(nnx.merge_state(b.tree(), a.tree()), self.scale, dtype)

            merged_shape = jax.eval_shape(merge, self._base, adapters)
            self._out_def = jax.tree.structure(merged_shape)
            self._merge = jax.jit(lambda b, a: jax.tree.leaves(merge(b, a)),
                                  out_shardings=jax.tree.leaves(logical_to_mesh_sharding(merged_shape, rollout_mesh)))
        else:
            self._merge = None
            self._out_def, self._order = merge_order(self.base, adapters.tree())
        self._lock = threading.Lock()
        self._latest: tuple[int, FlatParams] | None = None
        self.publish_count = 0
        self.last_publish_s = 0.0
        self.last_bytes = 0

    def reshard(self, params: nnx.State | FlatParams) -> FlatParams:
        """The sampler's params for `params` (a full adapted state, or the adapters alone, as an nnx.State or held
        flat), held flat: only the adapters are copied to the rollout slice; never aliases the input buffers."""
        if isinstance(params, FlatParams) and params.treedef == self._adapter_def:
            adapters = params
        else:
            adapters = FlatParams.of(split_adapters(as_tree(params))[0])
        on_rollout = self._adapters.reshard(adapters)
        self.last_bytes = self._adapter_bytes
        if self._merge is not None:
            return FlatParams(self._merge(self._base, on_rollout), self._out_def)
        return merged_flat(self._base.leaves, on_rollout.leaves, self._out_def, self._order)

    def publish(self, version: int, params: nnx.State | FlatParams) -> FlatParams:
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

    def latest(self) -> tuple[int, FlatParams] | None:
        """The most recent (version, sampler params), or None before the first publish."""
        with self._lock:
            return self._latest
