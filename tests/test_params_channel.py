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


def test_flat_params_round_trip_and_decode_like_the_state():
    """FlatParams holds the same leaves in the same order, rebuilds the very nnx.State, and an engine
    given it decodes exactly as one given the State."""
    from areal_jax.models import FlatParams, as_tree
    from areal_jax.sampler import Engine, SamplingParams

    model = random_model(tiny_config())
    params = nnx.split(model)[1]
    flat = FlatParams.of(params)
    assert FlatParams.of(flat) is flat
    assert all(a is b for a, b in zip(jax.tree.leaves(flat), jax.tree.leaves(params)))
    assert jax.tree.structure(flat.tree()) == jax.tree.structure(params) and as_tree(params) is params
    doubled = jax.jit(lambda p: jax.tree.map(lambda x: 2 * x, p))(flat)
    assert isinstance(doubled, FlatParams) and doubled.treedef == flat.treedef
    for got, x in zip(doubled.leaves, flat.leaves):
        np.testing.assert_array_equal(np.asarray(got), 2 * np.asarray(x))
    with pytest.raises(ValueError, match="2 leaves for a tree of"):
        FlatParams(flat.leaves[:2], flat.treedef)

    engine = Engine(model, num_slots=2, max_len=32)
    outs = []
    for p in (params, flat):
        state = engine.init_decode_state()
        state = engine.insert(engine.prefill(p, [5, 6, 7]), state, 0, SamplingParams(temperature=0.0, max_new_tokens=6))
        tokens = []
        for step in range(6):
            state, result = engine.generate(p, state, jax.random.key(step))
            tokens.append((int(result.tokens[0]), float(result.logprobs[0])))
        outs.append(tokens)
    assert outs[0] == outs[1]


def test_layout_check_names_the_leaf_that_differs():
    from areal_jax.models import FlatParams
    from areal_jax.models.flat_params import check_same_layout

    params = nnx.split(random_model(tiny_config()))[1]
    wider = nnx.split(random_model(tiny_config(intermediate_size=40)))[1]
    check_same_layout(params, FlatParams.of(params))  # the same layout, either form: no error
    with pytest.raises(ValueError, match=r"mlp.*has shape .* the sampler's model has"):
        check_same_layout(FlatParams.of(params), wider)
    with pytest.raises(ValueError, match="different tree structure"):
        check_same_layout(params, nnx.split(random_model(tiny_config(num_layers=3)))[1])


def test_handoff_benchmark_at_toy_size(capsys):
    """benchmarks/handoff.py runs end to end and reports the bytes a bf16 hand-off writes (half the
    float32 source) and positive timings, in its last line of JSON."""
    import json

    from areal_jax.testing.scripts import load_script

    mod = load_script("benchmarks/handoff.py")
    report = mod.main(["--preset", "tiny", "--host-only", "--repeats", "2"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(report))
    assert report["leaves"] == 26 and report["bytes_written"] * 2 == report["source_bytes"]
    for key in ("reshard_s", "publish_to_swap_s", "raw_copy_s", "dispatch_state_s", "dispatch_flat_s", "apply_s",
                "apply_with_copy_s", "owned_publish_to_swap_s"):
        assert report[key] > 0
    # The copy the update writes reaches the sampler with no second copy (one device, the sampler's layout).
    assert report["owned_handed_over"] is True
    assert report["update_written_handoff_s"] == report["copy_in_update_s"] + report["owned_publish_to_swap_s"]
