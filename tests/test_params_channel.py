"""ParamChannel: the sampler's copy equals the trainer's params, lives on the rollout slice, and survives
the trainer donating its buffers (colocated and split)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import shard_params
from areal_jax.runtime.mesh import MeshConfig, build_meshes
from areal_jax.system.params import ParamChannel
from areal_jax.testing.models import random_model, tiny_config


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


@pytest.mark.parametrize("split,n_devices", [
    (MeshConfig(), 1),
    (MeshConfig(train_devices=2, rollout_devices=2), 4),
    (MeshConfig(train_devices=2, rollout_devices=2, rollout_tensor=2), 4),
    (MeshConfig(train_devices=1, rollout_devices=3), 4),
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, None])
def test_handoff_equals_host_cast_bit_for_bit_and_never_touches_the_host(split, n_devices, dtype):
    """The bf16 sampler copy is the float32 train weights cast on the device: bit for bit what a
    host-side cast gives (round to nearest even), and no byte goes through the host on the way, also
    when the two slices lay the params out differently (dtype None: a plain float32 copy)."""
    import ml_dtypes

    meshes = build_meshes(split, devices=jax.devices()[:n_devices])
    model = shard_params(random_model(tiny_config()), meshes.train_mesh)
    params = nnx.state(model)
    # Values that exercise the rounding: ties to even, subnormals, the largest finite, inf and nan.
    leaves, treedef = jax.tree.flatten(params)
    special = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1e-40, -3e-39, 3.4e38, np.inf, -np.inf,
                        np.nan, 0.0, -0.0, 2**-126 * (1 - 2**-9)], np.float32)
    first = np.asarray(leaves[0]).copy().reshape(-1)
    first[: special.size] = special
    leaves[0] = jax.device_put(first.reshape(leaves[0].shape), leaves[0].sharding)
    params = jax.tree.unflatten(treedef, leaves)
    host = [np.asarray(x).astype(ml_dtypes.bfloat16 if dtype else np.float32) for x in jax.tree.leaves(params)]
    channel = ParamChannel.for_model(params, meshes.rollout_mesh, train_mesh=meshes.train_mesh, dtype=dtype)
    channel.reshard(params)  # compile first: compiling may move constants, copying must not
    # Any host <-> device transfer raises; device-to-device copies are allowed.
    with jax.transfer_guard_host_to_device("disallow_explicit"), jax.transfer_guard_device_to_host("disallow_explicit"):
        out = channel.reshard(params)
        jax.block_until_ready(out)
    assert channel.last_bytes == sum(h.nbytes for h in host)
    rollout_devices = set(meshes.rollout_mesh.devices.flat)
    for got, want in zip(jax.tree.leaves(out), host):
        assert got.dtype == want.dtype and got.sharding.device_set <= rollout_devices
        bits = np.uint16 if dtype else np.uint32
        np.testing.assert_array_equal(np.asarray(got).view(bits), want.view(bits))
