"""TrainState: the trainer's params, optimizer state and counters, sharded on the train mesh."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models import logical_to_mesh_sharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything one PPO update reads and replaces (donated to the update).

    Attributes:
      params: nnx.State of the model's nnx.Param variables (sharded by the model's logical axes).
      opt_state: optax state of `make_optimizer(cfg)`; per-param moments share the params' shardings.
      step: int32 [] optimizer steps applied (skipped steps excluded; drives the lr schedule).
      version: int32 [] policy version = number of `Trainer.update` calls made.
      skipped_updates: int32 [] optimizer steps skipped because the gradients were not finite.
      value_head: the critic's value head {"kernel": [D, 1], "bias": [1]} float32 (replicated), trained
        with the params (then opt_state is that of the pair (params, value_head)); None without a critic.
        Saved and restored with the state; never sent to the sampler.
    """

    params: nnx.State
    opt_state: Any
    step: jax.Array
    version: jax.Array
    skipped_updates: jax.Array
    value_head: Any = None

    def trainable(self) -> Any:
        """What the optimizer updates: params, or (params, value_head) with a critic."""
        return self.params if self.value_head is None else (self.params, self.value_head)

    def with_trainable(self, trainable: Any, **changes: Any) -> "TrainState":
        """A copy whose params (and value head) are `trainable` (shaped like self.trainable())."""
        if self.value_head is None:
            return dataclasses.replace(self, params=trainable, **changes)
        params, head = trainable
        return dataclasses.replace(self, params=params, value_head=head, **changes)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_global(tree: Any, shardings: Any) -> Any:
    """Place a pytree of host arrays (numpy or scalars, identical on every process) onto shardings.

    With one process this is `jax.device_put`. With several, every process holds the same values
    and provides the shards its own devices own (`jax.make_array_from_callback`).
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def place(x, sharding):
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    if isinstance(shardings, jax.sharding.Sharding):  # one sharding for every leaf, as device_put allows
        return jax.tree.map(lambda x: place(x, shardings), tree)
    return jax.tree.map(place, tree, shardings)


def copy_to(tree: Any, shardings: Any) -> Any:
    """Fresh copies of a pytree of arrays on the given shardings, never aliasing the inputs.

    The trainer donates its state, so its buffers must not be shared with the caller's model
    (`jax.device_put` may reuse the source buffer for one shard, and donating that shard would
    delete the caller's array).
    """
    if jax.process_count() == 1:
        return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(tree)

    # Several processes: arrays already spread over the global mesh are copied by a jitted copy (every
    # process takes part); host values and process-local arrays are placed from their host copy.
    def place(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.jit(jnp.copy, out_shardings=sharding)(x)
        return put_global(x, sharding)

    return jax.tree.map(place, tree, shardings)


def param_shardings(params: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding per param from the model's logical axis rules (same pytree as params)."""
    return logical_to_mesh_sharding(params, mesh)


def train_state_shardings(params: nnx.State, tx: optax.GradientTransformation, mesh: Mesh,
                          value_head: Any = None) -> TrainState:
    """A TrainState-shaped pytree of NamedSharding: moments follow their params, scalars (and the value
    head, when given) replicate."""
    rep = replicated(mesh)
    p_shard = param_shardings(params, mesh)
    h_shard = None if value_head is None else jax.tree.map(lambda _: rep, value_head)
    like = TrainState(params=p_shard, opt_state=None, step=rep, version=rep, skipped_updates=rep,
                      value_head=h_shard)
    trainable = params if value_head is None else (params, value_head)
    opt_shape = jax.eval_shape(tx.init, trainable)
    o_shard = optax.tree_map_params(
        tx, lambda _, s: s, opt_shape, like.trainable(), transform_non_params=lambda _: rep
    )
    return dataclasses.replace(like, opt_state=o_shard)


def create_train_state(
    params: nnx.State, tx: optax.GradientTransformation, mesh: Mesh, *, version: int = 0,
    value_head: Any = None,
) -> tuple[TrainState, TrainState]:
    """Initialise the optimizer and place everything on the train mesh.

    Args:
      params: the model's nnx.Param state (any placement; values identical on every process).
      tx: the optimizer.
      mesh: the train mesh (axes "fsdp", "tensor").
      version: starting policy version.
      value_head: the critic's value head (trainer.logprobs.init_value_head), or None.
    Returns:
      (state, shardings): the placed TrainState and the matching pytree of NamedSharding.
    """
    shardings = train_state_shardings(params, tx, mesh, value_head)
    placed_params = copy_to(params, shardings.params)
    placed_head = None if value_head is None else copy_to(value_head, shardings.value_head)
    trainable = placed_params if value_head is None else (placed_params, placed_head)
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(trainable)
    counters = put_global(
        (jnp.zeros((), jnp.int32), jnp.asarray(version, jnp.int32), jnp.zeros((), jnp.int32)),
        (shardings.step, shardings.version, shardings.skipped_updates),
    )
    state = TrainState(
        params=placed_params, opt_state=opt_state, step=counters[0], version=counters[1],
        skipped_updates=counters[2], value_head=placed_head,
    )
    return state, shardings
