"""Expert weights with LoRA adapters kept as their factors (`Factored`), for `models.moe`'s expert paths: each path's
grouped product of rows by expert weights (`grouped`), and their shard_map specs (`weight_specs`)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from areal_jax.models.sharding import placement_spec


@jax.tree_util.register_pytree_node_class
class Factored:
    """An expert weight kept as base [E, in, out] + scale * a [E, in, r] @ b [E, r, out] (LoRA on the experts,
    `lora.LoRAExperts`), never formed: each path multiplies a token's rows by its expert's base and, through the
    rank-r factors, by the adapter. The backward then computes no [E, in, out] weight gradient (the base is frozen),
    only the factors' rank-r ones. Every expert path takes a Factored wherever it takes an expert weight."""

    def __init__(self, base: jax.Array, a: jax.Array, b: jax.Array, scale: float):
        self.base, self.a, self.b, self.scale = base, a, b, scale

    def tree_flatten(self):
        return (self.base, self.a, self.b), self.scale

    @classmethod
    def tree_unflatten(cls, scale, children):
        return cls(*children, scale)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape


def grouped(z: jax.Array, w: Any, mm, out_dtype: Any = None) -> jax.Array:
    """A path's grouped product of rows z by expert weights w: mm(z, W [E, in, out], out_dtype) multiplies each row
    by its expert's matrix. For a `Factored` w: base's product + scale * mm(mm(z, a), b), summed in float32."""
    if not isinstance(w, Factored):
        return mm(z, w, out_dtype)
    delta = mm(mm(z, w.a, None), w.b, jnp.float32)
    return (mm(z, w.base, jnp.float32) + w.scale * delta).astype(out_dtype or z.dtype)


def weight_specs(p: Any, axes: frozenset[str]) -> Any:
    """The shard_map in_spec of an expert layer's parameter `p` (an nnx Variable, a `lora.LoRAExperts`, or None):
    its placement on the context's mesh over the manual `axes` (`sharding.placement_spec`); a `Factored` of its
    base's and factors' for LoRA experts."""
    if p is None:
        return PartitionSpec()
    if hasattr(p, "lora_a"):
        return Factored(*(placement_spec(v, axes) for v in (p.base, p.lora_a, p.lora_b)), p.scale)
    return placement_spec(p, axes)
