"""Sharding rules: logical axis names -> NamedSharding, sharded forward == single-device forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from areal_jax.models import LOGICAL_AXIS_RULES, init_cache, logical_to_mesh_sharding, shard_params
from areal_jax.models.sharding import logical_to_spec
from areal_jax.testing.models import random_model, tiny_config


def _mesh(axis_type=AxisType.Auto):
    assert len(jax.devices()) >= 4, "needs 4 devices: tests/conftest.py forces 4 CPU devices; run through pytest"
    return jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(axis_type, axis_type))


def test_logical_to_spec_rules_and_fallback():
    mesh = _mesh()
    assert logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 16), mesh) == P("fsdp", "tensor", None)
    # 97 is not divisible by the tensor axis size: replicated on that dimension only.
    assert logical_to_spec(("vocab", "embed"), (97, 64), mesh) == P(None, "fsdp")
    assert logical_to_spec(("norm",), (64,), mesh) == P(None)
    assert logical_to_spec(None, (3, 3), mesh) == P()
    # A mesh axis is used at most once per array; axes missing from the mesh mean replicated.
    rules = (("embed", "tensor"), ("mlp", "tensor"), ("vocab", "data"))
    assert logical_to_spec(("embed", "mlp"), (64, 96), mesh, rules) == P("tensor", None)
    assert logical_to_spec(("vocab", "mlp"), (64, 96), mesh, rules) == P(None, "tensor")
    assert dict(LOGICAL_AXIS_RULES)["embed"] == "fsdp" and dict(LOGICAL_AXIS_RULES)["kv_heads"] == "tensor"


def test_shardings_follow_state_structure():
    mesh = _mesh()
    model = random_model(tiny_config("qwen2"))
    shardings = logical_to_mesh_sharding(model, mesh)
    state = nnx.state(model)
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    assert shardings["layers"][0]["attn"]["q_proj"].get_value().spec == P("fsdp", "tensor", None)
    assert shardings["layers"][1]["attn"]["k_bias"].get_value().spec == P("tensor", None)
    assert shardings["layers"][0]["mlp"]["down_proj"].get_value().spec == P("tensor", "fsdp")
    assert shardings["embedding"].get_value().spec == P(None, "fsdp")
    # Works on abstract states too (used to load checkpoints straight into sharded arrays).
    _, abstract = nnx.split(nnx.eval_shape(lambda: random_model(tiny_config("qwen2"))))
    assert jax.tree.structure(logical_to_mesh_sharding(abstract, mesh)) == jax.tree.structure(state)


@pytest.mark.parametrize("arch,axis_type", [("qwen2", AxisType.Auto), ("qwen3", AxisType.Explicit),
                                            ("llama", AxisType.Auto), ("gemma3", AxisType.Auto),
                                            ("olmo3", AxisType.Explicit)])
def test_sharded_forward_matches_single_device(arch, axis_type):
    mesh = _mesh(axis_type)
    cfg = tiny_config(arch, tie_word_embeddings=arch == "qwen3")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 9)), jnp.int32)
    reference = random_model(cfg, seed=5)(tokens)
    model = shard_params(random_model(cfg, seed=5), mesh)
    q = model.layers[0].attn.q_proj[...]
    assert len(q.sharding.device_set) == 4 and q.addressable_shards[0].data.shape == (32, 2, 16)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
    np.testing.assert_allclose(forward(state, tokens), reference, atol=1e-5, rtol=1e-5)
    # The cache path under sharding, too.
    decode = jax.jit(lambda st, t, p, c: nnx.merge(graphdef, st)(t, p, cache=c))
    logits, _ = decode(state, tokens, jnp.broadcast_to(jnp.arange(9), (4, 9)), init_cache(cfg, 4, 12))
    np.testing.assert_allclose(logits, reference, atol=1e-5, rtol=1e-5)
