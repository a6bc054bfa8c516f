"""The sampler's copy of the weights, written by the optimizer step that ends each update.

A hand-off used to be a program of its own after the update: read the float32 params, write them cast
to the sampler's dtype. That read costs twice the bytes the copy writes (a bf16 copy of float32 weights
moves 1.5x the traffic of a raw copy of the same bytes), and the program has one output per leaf to
launch and bookkeep. The optimizer step already reads the params and writes the new ones, so with
`Trainer.keep_sampler_copy(dtype)` the step that ends an update also writes the new params cast to
`dtype`, fused into the same elementwise work: the only added device traffic is the write of the copy.

The copy is a set of fresh buffers that no later update donates (the trainer's own params are donated to
the next update; the copy is an output nothing reads back), so the ParamChannel can hand it to a sampler
on the same devices without copying it again (`ParamChannel.publish(..., owned=True)`).

Frozen, non-trained variables (`other`, e.g. a LoRA base, kept out of this path by the job) are cast once
and reused. A version the update did not write (the first publish, a restored checkpoint) is cast on
demand by one jitted copy.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.flat_params import FlatParams, cast_leaves, merge_order, merged_flat


class SamplerCopy:
    """The trainer's params in the sampler's dtype, per version.

    Args:
      dtype: the sampler's floating dtype; None keeps the params' own.
      params: the trainer's params (TrainState.params), for their structure and layout.
      other: the trainer's frozen variables (merged with the params into the tree the sampler takes).
      shardings: where to write the copy, one sharding per leaf of the merged tree (in its flattening order) on
        the train devices: the sampler's own layout when both share the devices, so that the sampler takes the
        copy as it is (no relayout, no per-leaf device_put); None keeps the params' layout.
    """

    def __init__(self, dtype: Any, params: nnx.State, other: nnx.State, shardings: Any = None):
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        n = len(jax.tree.leaves(params))
        # Where each leaf of the merged tree comes from: index i < n is the params' leaf i, n + j other's leaf j.
        self._treedef, self._order = merge_order(params, other)
        self.param_shardings = other_shardings = None
        if shardings is not None:
            shardings = list(shardings)
            if len(shardings) != len(self._order):
                raise ValueError(f"keep_sampler_copy got {len(shardings)} shardings for {len(self._order)} leaves.")
            by_source = {src: shardings[i] for i, src in enumerate(self._order)}
            self.param_shardings = tuple(by_source[j] for j in range(n))
            other_shardings = [by_source[j] for j in range(n, len(self._order))]
        self._other = (jax.jit(lambda o: cast_leaves(o, self.dtype), out_shardings=other_shardings)(other)
                       if jax.tree.leaves(other) else [])
        self._cast = jax.jit(lambda p: cast_leaves(p, self.dtype),
                             out_shardings=None if shardings is None else list(self.param_shardings))
        self._latest: tuple[int, list[jax.Array]] | None = None

    @property
    def step_key(self) -> tuple:
        """The arguments of UpdateFns.apply_cast that write this copy."""
        return self.dtype, self.param_shardings

    def record(self, version: int, leaves: list[jax.Array]) -> None:
        """The update that produced `version` wrote these (the params' leaves, cast)."""
        self._latest = (int(version), list(leaves))

    def forget(self) -> None:
        """Drop the recorded copy (the params were replaced, e.g. restored from a checkpoint)."""
        self._latest = None

    def take(self, version: int, params: nnx.State) -> FlatParams:
        """The whole tree (params and frozen variables) in `dtype` at `version`: the copy the update wrote,
        handed out once (this object lets go of it, so a copy moved to other devices does not stay on the train
        slice), else a cast of `params` (which must be the params at `version`) made now."""
        written, self._latest = self._latest, None
        leaves = written[1] if written is not None and written[0] == int(version) else self._cast(params)
        return merged_flat(leaves, self._other, self._treedef, self._order)
