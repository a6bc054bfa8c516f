"""Logical axis names -> mesh shardings for model parameters.

Every parameter carries logical axis names in its `out_sharding` metadata ("embed", "vocab", "heads",
"kv_heads", "head_dim", "mlp", "norm" or None). `LOGICAL_AXIS_RULES` maps each name to a mesh axis (or a
tuple of mesh axes, or None for replicated). A dimension whose size is not divisible by the product of its
mesh axes' sizes, or whose mesh axis is absent from the mesh or already used by another dimension, is
replicated instead, so even tiny models shard on any mesh.

The model's einsums rely on XLA's sharding propagation, so parameters are placed on a mesh whose axes are
all `AxisType.Auto` (a mesh with Explicit axes, the default of `jax.make_mesh`, is converted; see
`auto_mesh`). Build meshes with `axis_types=(AxisType.Auto,) * n` to share them with other arrays.

Activations. Propagation alone follows the weights: with FSDP weights sharded on "embed", XLA shards the residual
stream on its hidden dimension and moves whole-batch activations between devices (measured on a 4-device fsdp mesh:
the accumulate program all-gathered and all-reduced [all tokens, width] tensors every layer, and computed with every
device's rows). A program traced under a mesh context (`jax.sharding.use_abstract_mesh`, as the trainer's are)
therefore pins each decoder layer's input and output to batch sharding over `BATCH_AXIS` (`constrain_batch`): each
device keeps its own rows, and only weights are gathered (FSDP). Without a context (the sampler, single-device
programs) it is a no-op.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("experts", "fsdp"),  # expert parallelism (models.expert_parallel): the experts' axis is their weights' first,
    # so it takes fsdp before their "embed" can
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
)


BATCH_AXIS = "fsdp"
TENSOR_AXIS = "tensor"


def context_axis_size(axis: str) -> int:
    """The size of mesh axis `axis` in the current mesh context (`jax.sharding.use_abstract_mesh`); 1 without a
    context or without that axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    return int(mesh.shape[axis])


def manual_axes(axes: frozenset[str], dtype: Any) -> frozenset[str]:
    """The axes a shard_map over `axes` of the context mesh that computes in `dtype` makes manual: those, and on the
    CPU for 16-bit dtypes every axis of size 1 as well (which splits nothing). A shard_map left automatic over some
    axis lowers with sharding constraints inside the reducers of its collectives, and XLA:CPU, which promotes 16-bit
    reductions to float32, cannot clone such a reducer and fails to compile a bfloat16 reduce-scatter. Manual over
    a size-1 axis it lowers without them, at the price of a no-op all-reduce (one device a group) of the inputs'
    cotangents in the backward, hence CPU and 16-bit only."""
    mesh = jax.sharding.get_abstract_mesh()
    if jax.default_backend() != "cpu" or np.dtype(dtype).itemsize >= 4:
        return frozenset(axes)
    return frozenset(axes) | frozenset(a for a in mesh.axis_names if mesh.shape[a] == 1)


def batch_shards() -> int:
    """How many ways the traced program's batch splits: the size of `BATCH_AXIS` in the current mesh context."""
    return context_axis_size(BATCH_AXIS)


def constrain_batch(x: jax.Array, axis: int = 0) -> jax.Array:
    """x with dimension `axis` sharded over `BATCH_AXIS` and the others replicated, when a mesh context splits the
    batch and the dimension divides; else x unchanged."""
    n = batch_shards()
    if n == 1 or x.shape[axis] % n:
        return x
    spec = [None] * x.ndim
    spec[axis] = BATCH_AXIS
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis of type Auto (returns `mesh` itself when it is)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names of a parameter, or None when it has none."""
    meta = variable.get_metadata()
    names = meta.get("out_sharding", meta.get("sharding_names", meta.get("sharding")))
    return None if names is None else tuple(names)


def logical_to_spec(names: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh,
                    rules: LogicalRules = LOGICAL_AXIS_RULES) -> PartitionSpec:
    """Maps logical names of an array of `shape` to a PartitionSpec on `mesh` (replicating what cannot shard)."""
    if names is None:
        return PartitionSpec()
    if len(names) != len(shape):
        raise ValueError(f"Logical axis names {tuple(names)} do not match an array of shape {tuple(shape)}.")
    table: Mapping[str, Any] = dict(rules)
    used: set[str] = set()
    spec: list[Any] = []
    for name, size in zip(names, shape):
        target = table.get(name) if name is not None else None
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        axes = tuple(a for a in axes if a in mesh.shape and a not in used)
        count = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or count == 1 or size % count:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def logical_to_mesh_sharding(state_or_model: Any, mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES) -> Any:
    """A pytree of NamedSharding with the structure of `nnx.state(model)` (or of the given state).

    Accepts a model, or a state from `nnx.state` / `nnx.split` (concrete or abstract values)."""
    state = nnx.state(state_or_model) if isinstance(state_or_model, nnx.Module) else state_or_model
    mesh = auto_mesh(mesh)

    def to_sharding(x: Any) -> Any:
        if _is_variable(x):
            value = x.get_value()
            spec = logical_to_spec(logical_names(x), np.shape(value), mesh, rules)
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(to_sharding, state, is_leaf=_is_variable)


def shard_params(model: nnx.Module, mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES) -> nnx.Module:
    """Places the model's state on `mesh` following `rules`, in place; returns the model."""
    state = nnx.state(model)
    shardings = logical_to_mesh_sharding(state, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    return model


def placement_spec(variable: nnx.Variable, axes: frozenset[str] | set[str]) -> PartitionSpec:
    """Inside a mesh context: the spec `variable` is placed with (`logical_to_spec` on the context's mesh), keeping
    only the mesh axes in `axes` (a shard_map's manual axes; the others it leaves to XLA)."""
    spec = logical_to_spec(logical_names(variable), variable.get_value().shape, jax.sharding.get_abstract_mesh())
    return PartitionSpec(*(a if a in axes else None for a in spec))


def gather_over(x: jax.Array, spec: PartitionSpec, axis: str, keep: Sequence[int] = ()) -> jax.Array:
    """Inside a shard_map: x's shard with every dimension that `spec` splits over mesh axis `axis` all-gathered whole,
    but those in `keep`. Its transpose reduce-scatters the gradient (where an input left whole by its in_spec would
    all-reduce it)."""
    for d, a in enumerate(spec):
        if a == axis and d not in keep:
            x = jax.lax.all_gather(x, axis, axis=d, tiled=True)
    return x
