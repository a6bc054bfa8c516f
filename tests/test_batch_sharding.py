"""Data-parallel activations under a mesh context (models.sharding.constrain_batch, the MoE's per-shard routing):
the compiled update moves weights between devices but never a tensor as long as the global batch, and gradients on a
2 x 2 mesh equal one device's for dense and mixture-of-experts models on every expert path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from areal_jax.models import shard_params
from areal_jax.models.sharding import batch_shards, constrain_batch
from areal_jax.testing.hlo import FLOATS, collectives
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig
from tests.test_trainer import mesh_1, mesh_4, tree_rel_err

ROWS, LENGTH = 4, 72  # no weight has a dimension of 72 or 288


def _collectives(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, shape) of every float collective of a compiled program (areal_jax.testing.hlo)."""
    return [(kind, shape) for kind, dtype, shape in collectives(text) if dtype in FLOATS]


def _compiled_step(cfg, with_context: bool) -> str:
    """The HLO of value_and_grad of a forward over [ROWS, LENGTH] tokens, FSDP params on a 4-device fsdp mesh."""
    mesh = jax.make_mesh((4, 1), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    graphdef, state = nnx.split(shard_params(random_model(cfg, seed=1), mesh))
    tokens = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (ROWS, LENGTH)),
                                        jnp.int32), NamedSharding(mesh, PartitionSpec("fsdp", None)))

    def loss(st, t):
        h = nnx.merge(graphdef, st).hidden(t)
        return jnp.mean(jnp.sum(h.astype(jnp.float32) ** 2, axis=-1))

    def step(st, t):
        if not with_context:
            return jax.value_and_grad(loss)(st, t)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.value_and_grad(loss)(st, t)

    return jax.jit(step).lower(state, tokens).compile().as_text()


def _token_sized(collectives) -> list:
    return [(k, s) for k, s in collectives if ROWS * LENGTH in s or LENGTH in s]


@pytest.mark.parametrize("arch,impl", [("qwen3", None), ("qwen3_moe", "blocked"), ("qwen3_moe", "pallas")])
def test_only_weights_cross_devices_under_a_mesh_context(arch, impl):
    kw = dict(hidden_size=128, intermediate_size=256, num_layers=1)
    if impl:  # FSDP experts (expert parallelism moves tokens instead: the next test)
        kw.update(moe_impl=impl, moe_intermediate_size=128, expert_parallel=False)
    cfg = tiny_config(arch, **kw)
    pinned = _collectives(_compiled_step(cfg, with_context=True))
    # weights are gathered (FSDP); of the activations, only the embedding lookup's rows move, by an all-to-all
    # from the table's hidden-dimension shards to their rows' devices (once, in the forward)
    assert pinned and {k for k, _ in _token_sized(pinned)} <= {"all-to-all"}, pinned
    assert sum(np.prod(s) for k, s in pinned if k == "all-to-all") <= ROWS * LENGTH * cfg.hidden_size // 4
    if impl != "pallas":  # without the context XLA follows the weights and moves whole-batch activations
        assert _token_sized(_collectives(_compiled_step(cfg, with_context=False)))


@pytest.mark.parametrize("impl,dispatch", [("blocked", "gather"), ("pallas", "gather"), ("blocked", "ring")])
def test_expert_parallelism_moves_tokens_and_never_the_experts(impl, dispatch):
    """4 experts on a 4-device fsdp mesh, one a device: no collective carries an expert's weights or their gradient;
    the layer's rows are all-gathered ([all rows, D], forward and backward) and its outputs reduce-scattered back to
    each device's own rows ([rows / 4, D]), as are the routing weights' cotangents ([rows / 4, k]). The ring moves
    only one device's rows, weights, outputs and their cotangents at a time, to its neighbour."""
    cfg = tiny_config("qwen3_moe", hidden_size=128, intermediate_size=256, num_layers=1, moe_impl=impl,
                      moe_intermediate_size=128, expert_dispatch=dispatch)
    assert cfg.expert_parallel and cfg.num_experts == 4
    pinned = _collectives(_compiled_step(cfg, with_context=True))
    expert = {(cfg.num_experts, 128, 128), (1, 128, 128), (128, 128)}  # [E, D, F] whole, one expert, a slice
    assert not [s for _, s in pinned if s in expert], pinned
    moved = sorted((k, s) for k, s in _token_sized(pinned) if k != "all-to-all")  # (the embedding lookup's)
    n, d, k = ROWS * LENGTH, cfg.hidden_size, cfg.num_experts_per_tok
    if dispatch == "ring":
        assert {s for _, s in moved} == {(n // 4, d), (n // 4, k)}, moved
        assert {kind for kind, _ in moved} == {"collective-permute"}, moved
        return
    assert moved == sorted([("all-gather", (n, d))] * 2 + [("all-gather", (n, k))]
                           + [("reduce-scatter", (n // 4, d))] * 2 + [("reduce-scatter", (n // 4, k))]), moved


def test_constrain_batch_is_a_no_op_without_a_context_or_a_divisible_batch():
    x = jnp.ones((6, 3))
    assert batch_shards() == 1 and constrain_batch(x) is x
    mesh = jax.make_mesh((4, 1), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert batch_shards() == 4
        assert constrain_batch(x) is x  # 6 rows do not split four ways


@pytest.mark.parametrize("arch,impl,attention", [
    ("qwen3", None, "auto"), ("qwen3", None, "flash"), ("qwen3_moe", "blocked", "auto"),
    ("qwen3_moe", "ragged", "auto"), ("qwen3_moe", "pallas", "auto")])
def test_update_gradients_on_a_2x2_mesh_equal_one_devices(arch, impl, attention):
    cfg = tiny_config(arch, **({"moe_impl": impl} if impl else {}))
    trajs = random_trajectories(10, vocab=97, min_len=5, max_len=40, seed=3)
    tc = TrainerConfig(micro_batch_tokens=64, logits_chunk=16, attention=attention)
    want_loss, want = Trainer(random_model(cfg, seed=2), tc, mesh_1()).loss_and_grads(trajs)
    got_loss, got = Trainer(random_model(cfg, seed=2), tc, mesh_4()).loss_and_grads(trajs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert tree_rel_err(jax.device_get(got), jax.device_get(want)) < 1e-5


def test_kernels_run_per_shard_of_rows_and_heads():
    """Under a mesh context the Pallas attention kernel and the MoE path sit inside a shard_map (XLA would otherwise
    gather their operands and run the whole batch on every device): over rows, and over heads where they divide."""
    from areal_jax.models.packed_attention import packed_attention

    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    q = jnp.ones((4, 16, 4, 16))
    k = jnp.ones((4, 16, 2, 16))
    seg = jnp.ones((4, 16), jnp.int32)

    def jaxpr(heads_k):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            attend = packed_attention(seg, "flash")
            return jax.make_jaxpr(attend)(q, k[:, :, :heads_k], k[:, :, :heads_k])

    top = jaxpr(2).jaxpr.eqns
    assert [e.primitive.name for e in top] == ["shard_map"] and "pallas_call" in str(top[0].params["jaxpr"])
    assert top[0].params["in_specs"][0] == PartitionSpec("fsdp", None, "tensor", None)
    one_kv = jaxpr(1).jaxpr.eqns  # a single key/value head cannot split: rows only
    assert one_kv[0].params["in_specs"][0] == PartitionSpec("fsdp", None, None, None)
    plain = jax.make_jaxpr(packed_attention(seg, "flash"))(q, k, k).jaxpr.eqns  # no context: the kernel as is
    assert "shard_map" not in [e.primitive.name for e in plain]


def test_experts_run_per_row_shard_and_per_width_shard():
    """Under a 2 x 2 mesh context a mixture of experts runs in a shard_map over rows and experts (fsdp) and over the
    experts' width (tensor: gate and up by columns, down by rows, outputs summed), so each device computes its own
    experts' slices; gradients are checked against one device in the update test above."""
    from flax import nnx as _nnx

    from areal_jax.models.moe import MoE

    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    layer = MoE(tiny_config("qwen3_moe", moe_impl="pallas"), rngs=_nnx.Rngs(0))
    x = jnp.ones((4, 8, 64))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        eqns = jax.make_jaxpr(lambda v: layer(v))(x).jaxpr.eqns
    (sm,) = [e for e in eqns if e.primitive.name == "shard_map"]
    assert sm.params["in_specs"][0] == PartitionSpec("fsdp", None)
    # the token mask, the given routes (replay), the router as placed (hidden over fsdp: gathered inside)
    assert sm.params["in_specs"][1:4] == (PartitionSpec("fsdp"), PartitionSpec("fsdp", None),
                                          PartitionSpec("fsdp", None))
    # each device's own experts (expert parallelism over fsdp), sliced by width over tensor
    assert sm.params["in_specs"][4:7] == (PartitionSpec("fsdp", None, "tensor"), PartitionSpec("fsdp", None, "tensor"),
                                          PartitionSpec("fsdp", "tensor", None))
    inner = str(sm.params["jaxpr"])
    assert "psum" in inner and inner.count("pallas_call") == 3
