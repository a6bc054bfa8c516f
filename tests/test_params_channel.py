"""ParamChannel: the sampler's copy equals the trainer's params, lives on the rollout slice, and survives
the trainer donating its buffers (colocated and split)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import shard_params
from areal_jax.models.testing import random_model, tiny_config
from areal_jax.system.mesh import MeshConfig, build_meshes
from areal_jax.system.params import ParamChannel


@pytest.mark.parametrize("split,n_devices", [
    (MeshConfig(), 1),  # one device: both slices share it and the layouts are identical
    (MeshConfig(colocated=True), 4),
    (MeshConfig(train_devices=2, rollout_devices=2), 4),
])
def test_publish_copies_onto_rollout_slice_and_survives_donation(split, n_devices):
    meshes = build_meshes(split, devices=jax.devices()[:n_devices])
    model = shard_params(random_model(tiny_config()), meshes.train_mesh)
    params = nnx.state(model)
    expected = jax.tree.map(lambda x: np.asarray(x), params)
    received = []
    channel = ParamChannel.for_model(params, meshes.rollout_mesh, train_mesh=meshes.train_mesh,
                                     deliver=lambda p, v: received.append((v, p)))
    out = channel.publish(3, params)
    assert received[0][0] == 3 and channel.latest()[0] == 3
    rollout_devices = set(meshes.rollout_mesh.devices.flat)
    for leaf in jax.tree.leaves(out):
        assert leaf.sharding.device_set <= rollout_devices
    # The trainer donates its state: every source buffer is deleted. The published copy must live on.
    donate = jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p), donate_argnums=0)
    donate(params)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), want)
