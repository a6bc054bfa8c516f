"""Expert parallelism (models.expert_parallel): each device of the fsdp axis keeps its own experts, the tokens are
all-gathered to them and the outputs reduce-scattered back. A layer's outputs and every gradient under a 4-device
mesh equal one device's, on every expert path, for softmax, biased (gpt-oss) and sigmoid (DeepSeek-V3) routers and
shared experts, including the worst case where every pair lands on one device; the grouped-matmul kernel skips the
blocks of other devices' experts."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from areal_jax.models import shard_params
from areal_jax.models.expert_parallel import expert_shards
from areal_jax.models.grouped_matmul import grouped_matmul
from areal_jax.models.moe import MoE
from areal_jax.testing.models import tiny_config

ROWS, D = 48, 64


def _mesh(fsdp: int, tensor: int):
    return jax.make_mesh((fsdp, tensor), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)


def _layer(arch: str, impl: str, experts: int, flat_router: bool, dispatch: str = "gather") -> MoE:
    cfg = tiny_config(arch, moe_impl=impl, num_experts=experts, expert_dispatch=dispatch)
    layer = MoE(cfg, rngs=nnx.Rngs(3))
    for name in ("experts_gate", "experts_up", "experts_down", "router"):  # O(1) outputs, distinct experts
        p = getattr(layer, name)
        p.set_value(0.2 * jax.random.normal(jax.random.key(len(name)), p.shape))
    if flat_router:  # every score ties: each token picks experts 0 and 1, both held by the first device
        layer.router.set_value(jnp.zeros(layer.router.shape))
    return layer


def _value_and_grads(layer: MoE, x: jax.Array, mesh=None, dispatched: bool = True):
    graphdef, state = nnx.split(layer)
    ct = jax.random.normal(jax.random.key(9), x.shape)

    def loss(st, x):
        out, extras = nnx.merge(graphdef, st)(x, jnp.ones(x.shape[0], bool))
        return jnp.sum(out * ct), (out, extras["stats"])

    if mesh is None:
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
    state = nnx.state(shard_params(nnx.merge(graphdef, state), mesh))
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("fsdp", None)))

    def in_context(st, x):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(st, x)

    text = str(jax.make_jaxpr(in_context)(state, x))
    if dispatched and layer.ring:  # the rows went round the ring, forward and backward, and were never gathered
        assert "ppermute" in text and "custom_vjp" in text and not re.search(rf"\[{ROWS},\d+\] = all_gather", text)
    elif dispatched:
        assert "all_gather" in text and "reduce_scatter" in text  # the expert-parallel dispatch ran
    return jax.jit(in_context)(state, x)


@pytest.mark.parametrize("arch,impl,flat,dispatch", [
    ("qwen3_moe", "blocked", False, "gather"), ("qwen3_moe", "blocked", True, "gather"),
    ("qwen3_moe", "ragged", True, "gather"), ("qwen3_moe", "dense", True, "gather"),
    ("qwen3_moe", "pallas", True, "gather"), ("gpt_oss", "blocked", False, "gather"),
    ("qwen2_moe", "blocked", False, "gather"), ("deepseek_v3", "blocked", False, "gather"),
    ("qwen3_moe", "blocked", False, "ring"), ("qwen3_moe", "blocked", True, "ring"),
    ("qwen3_moe", "ragged", False, "ring"), ("qwen3_moe", "dense", True, "ring"),
    ("qwen3_moe", "pallas", False, "ring"), ("gpt_oss", "blocked", False, "ring"),
    ("deepseek_v3", "blocked", False, "ring")])
def test_a_layer_on_four_devices_equals_one_device(arch, impl, flat, dispatch):
    """8 experts over fsdp = 4 (two a device), tensor = 1; with `flat` every pair goes to the first device; the
    rows all-gathered ("gather") or passed round the ring ("ring", its own backward)."""
    layer = _layer(arch, impl, 8, flat, dispatch)
    x = jax.random.normal(jax.random.key(1), (ROWS, D))
    (_, (want, want_stats)), (want_grads, want_dx) = _value_and_grads(layer, x)
    (_, (got, got_stats)), (got_grads, got_dx) = _value_and_grads(layer, x, _mesh(4, 1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_stats), np.asarray(want_stats), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_dx), np.asarray(want_dx), atol=1e-5, rtol=1e-4)
    moved = 0
    for (path, g), w in zip(jax.tree.leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4, err_msg=str(path))
        moved += float(jnp.abs(w).sum()) > 0
    assert moved >= 4  # router and the three expert weights at least take gradients
    if flat:  # experts 2..7 (the other devices') were never picked: exact zero gradients there
        gate = np.asarray(got_grads["experts_gate"][...])
        assert not gate[2:].any() and gate[:2].any()


@pytest.mark.parametrize("dispatch", ["gather", "ring"])
def test_experts_and_width_split_together(dispatch):
    """fsdp = 2 (two experts a device) x tensor = 2 (each expert's width halved), against one device."""
    layer = _layer("qwen3_moe", "blocked", 4, False, dispatch)
    x = jax.random.normal(jax.random.key(2), (ROWS, D))
    (_, (want, _)), (want_grads, _) = _value_and_grads(layer, x)
    (_, (got, _)), (got_grads, _) = _value_and_grads(layer, x, _mesh(2, 2))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4)


def test_when_experts_split_over_devices():
    assert expert_shards(128, 8, True) == 8 and expert_shards(60, 8, True) == 1  # Qwen2-MoE's 60 over 8: FSDP
    assert expert_shards(128, 8, False) == 1 and expert_shards(128, 1, True) == 1
    cfg = tiny_config("qwen3_moe", num_experts=6)  # 6 experts over fsdp = 4 do not divide: FSDP placement
    model = shard_params(MoE(cfg, rngs=nnx.Rngs(0)), _mesh(4, 1))
    assert model.experts_gate[...].sharding.spec == PartitionSpec(None, "fsdp", None)
    model = shard_params(MoE(tiny_config("qwen3_moe", num_experts=8), rngs=nnx.Rngs(0)), _mesh(4, 1))
    assert model.experts_gate[...].sharding.spec == PartitionSpec("fsdp", None, None)
    off = shard_params(MoE(tiny_config("qwen3_moe", num_experts=8, expert_parallel=False), rngs=nnx.Rngs(0)),
                       _mesh(4, 1))
    assert off.experts_gate[...].sharding.spec == PartitionSpec(None, "fsdp", None)


def test_the_kernel_skips_blocks_of_no_expert():
    """Blocks owned by E (past the weights' experts: another device's pairs) come out zero and take no gradient;
    the other blocks are the plain per-block product (Pallas interpreter)."""
    rng = np.random.default_rng(0)
    owner = jnp.asarray([0, 1, 1, 2, 2, 2], jnp.int32)  # E = 2: the last three blocks belong to no expert
    x = jnp.asarray(rng.normal(size=(6 * 16, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 32, 48)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(6 * 16, 48)), jnp.float32)
    got = grouped_matmul(x, w, owner, block=16)
    want = jnp.einsum("bik,bkn->bin", x.reshape(6, 16, -1), w[jnp.minimum(owner, 1)]).reshape(96, -1)
    want = want * (jnp.repeat(owner, 16) < 2)[:, None]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    gx, gw = jax.grad(lambda a, b: jnp.sum(grouped_matmul(a, b, owner, block=16) * ct), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(lambda a, b: jnp.sum(
        jnp.einsum("bik,bkn->bin", a.reshape(3, 16, -1), b[jnp.asarray([0, 1, 1])]).reshape(48, -1) * ct[:48]),
        argnums=(0, 1))(x[:48], w)
    np.testing.assert_allclose(np.asarray(gx[:48]), np.asarray(rx), atol=5e-5, rtol=1e-5)
    assert not np.asarray(gx[48:]).any()
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), atol=5e-5, rtol=1e-5)


def test_ring_trains_expert_adapters_and_whole_updates_like_one_device():
    """The ring's own backward on a 4-device fsdp mesh: a full update of a 3-layer model (its layers scanned and
    rematerialised) and a LoRA update (frozen experts, adapters on them and on the attention: the ring computes no
    gradient for the frozen weights) give one device's loss and gradients."""
    from areal_jax.models import lora
    from areal_jax.runtime.mesh import MeshConfig, build_meshes
    from areal_jax.testing.models import random_model
    from areal_jax.testing.trajectories import random_trajectories
    from areal_jax.trainer import Trainer, TrainerConfig
    from tests.test_trainer import mesh_1, tree_rel_err

    cfg = tiny_config("qwen3_moe", num_layers=3, moe_layers=(1, 0, 1), num_experts=8, expert_dispatch="ring")
    mesh = build_meshes(MeshConfig(colocated=True, fsdp=4, tensor=1)).train_mesh
    trajs = random_trajectories(10, vocab=97, min_len=5, max_len=40, seed=3)
    for adapters in (False, True):
        tc = TrainerConfig(micro_batch_tokens=64, logits_chunk=16, remat="none" if adapters else "full",
                           scan_layers=not adapters)
        def model():
            m = random_model(cfg, seed=2)
            if adapters:
                lora.apply_lora(m, lora.LoRAConfig(rank=4, alpha=8.0, targets="all,experts"), rngs=nnx.Rngs(5))
                for i, node in enumerate(n for _, n in nnx.iter_graph(m) if isinstance(n, lora.LoRAExperts)):
                    node.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(i), node.lora_b.shape))
            return m

        wrt = nnx.LoRAParam if adapters else nnx.Param
        want_loss, want = Trainer(model(), tc, mesh_1(), wrt=wrt).loss_and_grads(trajs)
        got_loss, got = Trainer(model(), tc, mesh, wrt=wrt).loss_and_grads(trajs)
        assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
        assert tree_rel_err(jax.device_get(got), jax.device_get(want)) < 1e-5
        experts = [g for path, g in jax.tree.leaves_with_path(jax.device_get(got)) if "experts_gate" in str(path)]
        assert experts and all(np.abs(np.asarray(g)).max() > 0 for g in experts)  # the ring's gradients arrived


def test_the_dispatch_knob_reaches_the_model_and_a_bad_one_fails_early(tmp_path):
    from areal_jax import config as config_lib
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.models import write_random_hf_checkpoint

    with pytest.raises(ValueError, match=r"expert_dispatch='all_to_all' is unknown; use one of auto, gather, ring"):
        tiny_config("qwen3_moe", expert_dispatch="all_to_all")
    with pytest.raises(config_lib.ConfigError, match="expert_dispatch"):
        config_lib.from_config_dict({"model": {"expert_dispatch": "all_to_all"}})
    job = config_lib.from_config_dict({"model": {"expert_dispatch": "ring"}})
    assert job.model.run_choices() == {"moe_impl": "auto", "expert_parallel": True, "expert_dispatch": "ring"}
    write_random_hf_checkpoint(tmp_path, tiny_config("qwen3_moe", num_layers=1))
    model = load_hf_checkpoint(tmp_path, **job.model.run_choices())
    assert model.cfg.expert_dispatch == "ring" and model.layers[0].mlp.ring


@pytest.mark.parametrize("expert_parallel,dispatch", [(False, "gather"), (True, "gather"), (True, "ring")])
def test_bfloat16_layers_compile_and_agree_on_four_devices(expert_parallel, dispatch):
    """bfloat16 compute on a 4 x 1 mesh: the layer's reduce-scatters compile on XLA:CPU (`sharding.manual_axes`)
    and the outputs and gradients agree with one device's within bfloat16's rounding."""
    cfg = tiny_config("qwen3_moe", moe_impl="blocked", num_experts=8, expert_parallel=expert_parallel,
                      expert_dispatch=dispatch, dtype=jnp.bfloat16)
    layer = MoE(cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(1), (ROWS, D), jnp.bfloat16)
    (_, (want, _)), (want_grads, _) = _value_and_grads(layer, x)
    (_, (got, _)), (got_grads, _) = _value_and_grads(layer, x, _mesh(4, 1), dispatched=expert_parallel)
    for g, w in zip(jax.tree.leaves((got, got_grads)), jax.tree.leaves((want, want_grads))):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.abs(g - w).max() <= 2e-2 * max(np.abs(w).max(), 1e-6)


def test_a_bfloat16_mixture_of_experts_runs_on_a_tensor_split_rollout_mesh():
    """A sampler's mesh (replica 1 x tensor 2: each expert's width split) with bfloat16 compute: the forward (the
    width shards' outputs summed by an all-reduce) compiles on XLA:CPU and agrees with one device's."""
    from jax.sharding import Mesh

    from areal_jax.testing.models import random_model

    cfg = tiny_config("qwen3_moe", num_layers=2, dtype=jnp.bfloat16)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("replica", "tensor"))
    model = random_model(cfg, seed=1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 12)), jnp.int32)
    want = np.asarray(model(tokens))
    graphdef, state = nnx.split(shard_params(model, mesh))

    def forward(st, t):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return nnx.merge(graphdef, st)(t)

    got = np.asarray(jax.jit(forward)(state, tokens))
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
