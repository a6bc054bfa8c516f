"""The sampler's copy written by the update's last optimizer step (trainer.publish): bit for bit the params
cast on the host, of the right version, never deleted by a later update's donation, and handed over by the
ParamChannel without a second copy where the layouts agree."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models import FlatParams, lora
from areal_jax.runtime.mesh import MeshConfig, build_meshes
from areal_jax.system.params import ParamChannel
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig

VOCAB = tiny_config().vocab_size


def trajs(seed):
    return random_trajectories(6, vocab=VOCAB, min_len=5, max_len=20, seed=seed)


def mesh_1():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))


def host_cast(tree, dtype):
    """Every leaf on the host, floating ones cast by numpy (round to nearest even)."""
    out = []
    for x in jax.tree.leaves(tree):
        x = np.asarray(x)
        out.append(x.astype(ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else x.dtype)
                   if np.issubdtype(x.dtype, np.floating) or x.dtype == ml_dtypes.bfloat16 else x)
    return out


def assert_bitwise(got_leaves, want_leaves):
    assert len(got_leaves) == len(want_leaves)
    for got, want in zip(got_leaves, want_leaves):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        bits = {2: np.uint16, 4: np.uint32}.get(want.dtype.itemsize)
        np.testing.assert_array_equal(got.view(bits) if bits else got, want.view(bits) if bits else want)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_copy_is_the_updated_params_cast_bit_for_bit(minibatches):
    trainer = Trainer(random_model(tiny_config(), seed=1),
                      TrainerConfig(lr=1e-2, micro_batch_tokens=48, logits_chunk=16, ppo_minibatches=minibatches),
                      mesh_1())
    trainer.keep_sampler_copy(jnp.bfloat16)
    first = trainer.sampler_copy()  # version 0: cast on demand
    assert first.treedef == FlatParams.of(trainer.params).treedef
    assert_bitwise(first.leaves, host_cast(trainer.params, jnp.bfloat16))
    trainer.update(trajs(1))
    assert trainer.version == 1 and trainer._copy._latest[0] == 1  # written by the update, not cast afterwards
    written = trainer._copy._latest[1]
    copy = trainer.sampler_copy()
    assert trainer._copy._latest is None  # taken: the trainer holds no reference to it any more
    assert set(map(id, written)) <= set(map(id, copy.leaves))
    assert_bitwise(copy.leaves, host_cast(trainer.params, jnp.bfloat16))
    again = trainer.sampler_copy()  # a second call casts a fresh copy of the same params
    assert not set(map(id, again.leaves)) & set(map(id, copy.leaves))
    assert_bitwise(again.leaves, host_cast(trainer.params, jnp.bfloat16))
    assert any(not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
               for a, b in zip(first.leaves, copy.leaves))  # the update moved the params


def test_copy_survives_the_next_updates_donation_in_the_params_own_dtype():
    """dtype None: a float32 copy of float32 params, the same values as the state's own outputs; the next
    update donates the state and must leave the copy alive and unchanged."""
    trainer = Trainer(random_model(tiny_config(), seed=2), TrainerConfig(lr=1e-2, micro_batch_tokens=48,
                                                                          logits_chunk=16), mesh_1())
    trainer.keep_sampler_copy(None)
    trainer.update(trajs(2))
    copy = trainer.sampler_copy()
    want = host_cast(trainer.params, None)
    pointers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(trainer.params)}
    assert not pointers & {x.unsafe_buffer_pointer() for x in copy.leaves}  # never the state's own buffers
    trainer.update(trajs(3))
    assert not any(x.is_deleted() for x in copy.leaves)
    assert_bitwise(copy.leaves, want)
    assert_bitwise(trainer.sampler_copy().leaves, host_cast(trainer.params, None))


def test_frozen_variables_join_the_copy_in_the_trees_order():
    """LoRA adapters trained, the base frozen: the copy is the whole merged tree (the frozen part cast once),
    leaf for leaf what trainer.params holds."""
    model = random_model(tiny_config(), seed=4)
    lora.apply_lora(model, lora.LoRAConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(0))
    trainer = Trainer(model, TrainerConfig(lr=1e-2, micro_batch_tokens=48, logits_chunk=16), mesh_1(),
                      wrt=nnx.LoRAParam)
    trainer.keep_sampler_copy(jnp.bfloat16)
    trainer.update(trajs(4))
    copy = trainer.sampler_copy()
    assert copy.treedef == FlatParams.of(trainer.params).treedef
    assert_bitwise(copy.leaves, host_cast(trainer.params, jnp.bfloat16))


def test_restore_forgets_the_written_copy():
    trainer = Trainer(random_model(tiny_config(), seed=5), TrainerConfig(lr=1e-2, micro_batch_tokens=48,
                                                                          logits_chunk=16), mesh_1())
    other = Trainer(random_model(tiny_config(), seed=6), trainer.cfg, mesh_1())
    trainer.keep_sampler_copy(jnp.bfloat16)
    other.update(trajs(5))
    trainer.update(trajs(5))
    trainer.restore(other.state, None)  # the same version (1), other params
    assert_bitwise(trainer.sampler_copy().leaves, host_cast(other.params, jnp.bfloat16))


def test_copy_without_keep_is_a_clear_error():
    trainer = Trainer(random_model(tiny_config(), seed=7), TrainerConfig(micro_batch_tokens=48), mesh_1())
    with pytest.raises(ValueError, match="keep_sampler_copy"):
        trainer.sampler_copy()


@pytest.mark.parametrize("split,n_devices,laid_out,handed_over", [
    (MeshConfig(), 1, False, True),  # one device: the copy already is what the sampler wants
    (MeshConfig(colocated=True, fsdp=4), 4, False, False),  # train sharded over 4, rollout tensor-split: moved
    (MeshConfig(colocated=True, fsdp=4), 4, True, True),  # ... unless the update writes it in the rollout layout
    (MeshConfig(colocated=True, fsdp=2, tensor=2, rollout_tensor=2), 4, True, True),  # two sampler replicas
    (MeshConfig(train_devices=2, rollout_devices=2), 4, False, False),  # other devices: a device-to-device copy
])
def test_channel_hands_an_owned_copy_over_without_copying_where_it_can(split, n_devices, laid_out, handed_over):
    meshes = build_meshes(split, devices=jax.devices()[:n_devices])
    trainer = Trainer(random_model(tiny_config(), seed=8), TrainerConfig(lr=1e-2, micro_batch_tokens=48,
                                                                          logits_chunk=16), meshes.train_mesh)
    channel = ParamChannel.for_model(trainer.params, meshes.rollout_mesh, train_mesh=meshes.train_mesh,
                                     dtype=jnp.bfloat16)
    trainer.keep_sampler_copy(jnp.bfloat16, channel.targets if laid_out else None)
    trainer.update(trajs(8))
    copy = trainer.sampler_copy()
    if laid_out:  # the sampler's own sharding objects: its engine relays nothing out
        assert all(x.sharding == t for x, t in zip(copy.leaves, channel.targets))
    got = channel.publish(trainer.version, copy, owned=True)
    assert channel.last_copied is not handed_over
    same = [a is b for a, b in zip(got.leaves, copy.leaves)]
    assert all(same) if handed_over else not any(same)  # the very buffers, or new ones
    want = host_cast(trainer.params, jnp.bfloat16)
    assert_bitwise(got.leaves, want)
    for leaf, target in zip(got.leaves, jax.tree.leaves(channel._targets)):
        assert leaf.sharding.is_equivalent_to(target, leaf.ndim)
    assert channel.last_bytes == meshes.rollout_mesh.shape["replica"] * sum(w.nbytes for w in want)  # a copy a replica
    # Not owned: always a copy, even when the layouts agree.
    channel.publish(trainer.version, copy)
    assert channel.last_copied
    trainer.update(trajs(9))  # donates the state; the published copy lives on
    assert_bitwise(got.leaves, want)
