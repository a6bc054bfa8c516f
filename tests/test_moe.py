"""Mixture-of-experts feed-forward (models.moe): routing against a NumPy reference, the blocked, ragged, pallas and
dense expert paths against a per-token loop (values) and each other (gradients), dropless token independence, sharded forward and
gradients, LoRA on a model with experts, config checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from areal_jax.models import Transformer, shard_params
from areal_jax.models.lora import LoRAConfig, apply_lora
from areal_jax.models.moe import MoE, expert_block, resolve_moe_impl, route
from areal_jax.testing.models import random_model, tiny_config


def _np_route(logits, k, renormalize):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    experts = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(p, experts, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


def test_route_matches_a_numpy_softmax_top_k():
    logits = np.random.default_rng(0).normal(size=(50, 6)).astype(np.float32) * 2
    for renormalize in (False, True):
        w, e = route(jnp.asarray(logits), 2, renormalize)
        rw, re = _np_route(logits.astype(np.float64), 2, renormalize)
        np.testing.assert_array_equal(np.asarray(e), re)
        np.testing.assert_allclose(np.asarray(w), rw, rtol=1e-5)
    w, _ = route(jnp.asarray(logits), 3, True)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    _, e = route(jnp.zeros((1, 4)), 2, False)  # a tie goes to the lower expert index
    assert np.asarray(e).tolist() == [[0, 1]]


def _moe(impl, arch="qwen3_moe", seed=0, **kw):
    cfg = tiny_config(arch, moe_impl=impl, **kw)
    layer = MoE(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for name in ("router", "experts_gate", "experts_up", "experts_down"):
        p = getattr(layer, name)
        fan_in = p.shape[0] if name == "router" else p.shape[1]
        p.set_value(jnp.asarray(rng.normal(size=p.shape) / np.sqrt(fan_in), jnp.float32))
    return cfg, layer


def _np_moe(layer, x, cfg):
    """Each token through its own top-k experts, one at a time (float64)."""
    router, gate, up, down = (np.asarray(getattr(layer, n)[...], np.float64)
                              for n in ("router", "experts_gate", "experts_up", "experts_down"))
    flat = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    weights, experts = _np_route(flat @ router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out = np.zeros_like(flat)
    for n, h in enumerate(flat):
        for w, e in zip(weights[n], experts[n]):
            g = h @ gate[e]
            out[n] += w * ((g / (1 + np.exp(-g)) * (h @ up[e])) @ down[e])
    return out.reshape(x.shape)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_every_expert_path_equals_a_per_token_loop(arch):
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 7, 64)), jnp.float32)
    for impl in ("blocked", "dense", "ragged", "pallas"):
        cfg, layer = _moe(impl, arch, num_experts=5, num_experts_per_tok=2 if arch == "mixtral" else 3,
                          norm_topk_prob=arch == "mixtral")
        np.testing.assert_allclose(np.asarray(layer(x)), _np_moe(layer, np.asarray(x), cfg), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [15, 300])  # blocks of 8 rows; of 64, with some experts' groups empty
def test_expert_paths_gradients_agree(tokens):
    x = jnp.asarray(np.random.default_rng(2).normal(size=(1, tokens, 64)), jnp.float32)
    t = jnp.asarray(np.random.default_rng(3).normal(size=(1, tokens, 64)), jnp.float32)
    grads = {}
    for impl in ("dense", "ragged", "blocked", "pallas"):
        _, layer = _moe(impl, seed=4)
        graphdef, state = nnx.split(layer)

        def loss(st, xx):
            return jnp.sum((nnx.merge(graphdef, st)(xx) - t) ** 2)

        grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x)
    flat_d = jax.tree.leaves(grads["dense"])
    assert len(flat_d) == 5  # router, three expert stacks, x
    for impl in ("ragged", "blocked", "pallas"):
        for d, r in zip(flat_d, jax.tree.leaves(grads[impl])):
            assert float(jnp.abs(d).max()) > 0  # every parameter gets a gradient, the router's through the weights
            scale = float(jnp.abs(d).max())  # float32 sums over up to 300 tokens in other orders
            np.testing.assert_allclose(np.asarray(r), np.asarray(d), atol=2e-5 * scale, rtol=1e-4)


@pytest.mark.parametrize("impl", ["blocked", "dense", "ragged", "pallas"])
def test_a_tokens_output_does_not_depend_on_the_rest_of_the_batch(impl):
    """No capacity, no dropped tokens: what the sampler computes for a token alone, the trainer computes for it in
    a packed batch (the PPO ratios rest on it)."""
    cfg, layer = _moe(impl, seed=5)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(1, 40, 64)), jnp.float32)
    crowd = jnp.asarray(rng.normal(size=(1, 40, 64)), jnp.float32).at[0, 17].set(x[0, 17])
    np.testing.assert_allclose(np.asarray(layer(crowd))[0, 17], np.asarray(layer(x))[0, 17], atol=1e-6)
    np.testing.assert_allclose(np.asarray(layer(x[:, 17:18]))[0, 0], np.asarray(layer(x))[0, 17], atol=1e-6)


def test_resolve_moe_impl_and_block_sizes():
    assert resolve_moe_impl("auto", "cpu") == "blocked" and resolve_moe_impl("auto", "gpu") == "blocked"
    assert resolve_moe_impl("auto", "tpu") == "ragged" and resolve_moe_impl("dense", "cpu") == "dense"
    # a GPU's decode step (bandwidth-bound over every expert's weights) runs dense, a training micro-step blocked
    assert resolve_moe_impl("auto", "gpu", tokens=256) == "dense" and resolve_moe_impl("auto", "gpu", 257) == "blocked"
    assert resolve_moe_impl("auto", "cpu", tokens=8) == "blocked" and resolve_moe_impl("auto", "tpu", 8) == "ragged"
    assert resolve_moe_impl("blocked", "gpu", tokens=8) == "blocked"
    # expert parallelism on GPUs: the kernel, which skips other devices' blocks without a host round trip
    assert resolve_moe_impl("auto", "gpu", 4096, expert_parallel=True) == "pallas"
    assert resolve_moe_impl("auto", "tpu", expert_parallel=True) == "ragged"
    assert resolve_moe_impl("auto", "cpu", expert_parallel=True) == "blocked"
    assert expert_block(30, 4) == 8 and expert_block(300 * 2, 4) == 128 and expert_block(1024, 128) == 8
    assert expert_block(16384 * 8, 128) == 128 and expert_block(2048 * 4, 16) == 128 and expert_block(640, 16) == 32


@pytest.mark.parametrize("impl", ["blocked", "ragged", "pallas", "dense"])
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_sharded_forward_and_gradients_match_one_device(impl, expert_parallel):
    assert len(jax.devices()) >= 4
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    cfg = tiny_config("qwen3_moe", moe_impl=impl, moe_layers=(1, 0), expert_parallel=expert_parallel)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (4, 9)), jnp.int32)
    reference = random_model(cfg, seed=8)
    model = shard_params(random_model(cfg, seed=8), mesh)
    gate = model.layers[0].mlp.experts_gate[...]
    # [E / fsdp, D, F / tensor]: each device's own experts, whole; FSDP: [E, D / fsdp, F / tensor]
    assert gate.addressable_shards[0].data.shape == ((2, 64, 16) if expert_parallel else (4, 32, 16))

    def loss(m, t):
        return jnp.mean(jax.nn.logsumexp(m(t), axis=-1))

    graphdef, state = nnx.split(model)

    def in_context(st, t):  # as the trainer traces: each device routes its own rows (models.sharding)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.value_and_grad(lambda s: loss(nnx.merge(graphdef, s), t))(st)

    want_val, want_grad = nnx.value_and_grad(loss)(reference, tokens)
    tokens = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec("fsdp", None)))
    inner = str(jax.make_jaxpr(in_context)(state, tokens))  # the experts' in_spec: each device's own, or FSDP's
    assert ("P('fsdp', None, 'tensor')" if expert_parallel else "P(None, 'fsdp', 'tensor')") in inner
    got_val, got_grad = jax.jit(in_context)(state, tokens)
    np.testing.assert_allclose(float(got_val), float(want_val), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4)


def test_lora_leaves_experts_alone_and_adapts_the_rest():
    cfg = tiny_config("qwen3_moe", moe_layers=(1, 0))
    lora = LoRAConfig(enabled=True, rank=4, targets="all")
    assert lora.target_paths(2, experts=(0,)) == [(0, "q"), (0, "k"), (0, "v"), (0, "o"), (1, "q"), (1, "k"),
                                                  (1, "v"), (1, "o"), (1, "gate"), (1, "up"), (1, "down")]
    model = apply_lora(random_model(cfg), lora, rngs=nnx.Rngs(0))
    assert isinstance(model.layers[0].mlp, MoE) and type(model.layers[0].mlp.experts_gate) is nnx.Param
    assert hasattr(model.layers[1].mlp.gate_proj, "lora_a") and hasattr(model.layers[0].attn.q_proj, "lora_a")
    with pytest.raises(ValueError, match="experts take no adapters"):
        apply_lora(random_model(tiny_config("mixtral")), LoRAConfig(enabled=True, targets="mlp"), rngs=nnx.Rngs(0))


def test_expert_config_checks():
    with pytest.raises(ValueError, match="need num_experts >= 1"):
        tiny_config("mixtral", num_experts=0)
    with pytest.raises(ValueError, match="need num_experts >= 1, the others take 0"):
        tiny_config("qwen3", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"num_experts_per_tok must lie in \[1, num_experts=4\]"):
        tiny_config("qwen3_moe", num_experts_per_tok=5)
    with pytest.raises(ValueError, match="moe_layers must hold num_layers=2 flags"):
        tiny_config("qwen3_moe", moe_layers=(1,))
    with pytest.raises(ValueError, match="moe_impl='fast' is unknown"):
        tiny_config("qwen3_moe", moe_impl="fast")
    with pytest.raises(ValueError, match="HF MixtralForCausalLM has experts in every layer"):
        tiny_config("mixtral", moe_layers=(1, 0)).to_hf_dict()
    with pytest.raises(ValueError, match="HF MixtralForCausalLM has experts of intermediate_size"):
        tiny_config("mixtral", moe_intermediate_size=8).to_hf_dict()
    cfg = tiny_config("qwen3_moe", moe_layers=(1, 1))
    assert cfg.moe_layers is None and cfg.layer_is_moe(1) and cfg.expert_size == 32
    assert tiny_config("qwen3_moe", moe_layers=(0, 1)).with_layers(3).moe_layers is None  # probes: expert layers
    model = Transformer(tiny_config("qwen3_moe", moe_layers=(0, 1)), rngs=nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert params == tiny_config("qwen3_moe", moe_layers=(0, 1)).num_params


def test_ungated_experts_on_every_path_equal_a_per_token_loop():
    """Nemotron-H's experts have no gate (`MoE.experts_gate` None): each path's output is relu(h @ up)^2 @ down of the
    token's top-k experts, weighted, and their gradients agree between the paths."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, 9, 64)), jnp.float32)
    outs, grads = {}, {}
    for impl in ("blocked", "dense", "ragged", "pallas"):
        cfg = tiny_config("nemotron_h", num_layers=1, moe_impl=impl, num_experts=5, num_experts_per_tok=2,
                          norm_topk_prob=True, moe_intermediate_size=32, mlp_layers=None)
        layer = MoE(cfg, rngs=nnx.Rngs(0))
        assert layer.experts_gate is None
        params = np.random.default_rng(8)
        for name in ("router", "experts_up", "experts_down"):
            p = getattr(layer, name)
            p.set_value(jnp.asarray(params.normal(size=p.shape) / np.sqrt(p.shape[0 if name == "router" else 1]),
                                    jnp.float32))
        router, up, down = (np.asarray(getattr(layer, n)[...], np.float64) for n in ("router", "experts_up", "experts_down"))
        flat = np.asarray(x, np.float64).reshape(-1, 64)
        weights, experts = _np_route(flat @ router, 2, True)
        want = np.zeros_like(flat)
        for n, h in enumerate(flat):
            for w, e in zip(weights[n], experts[n]):
                want[n] += w * (np.maximum(h @ up[e], 0) ** 2 @ down[e])
        outs[impl] = np.asarray(layer(x))
        np.testing.assert_allclose(outs[impl], want.reshape(x.shape), atol=2e-5, rtol=1e-5)
        graphdef, state = nnx.split(layer)
        grads[impl] = jax.grad(lambda st: jnp.sum(jnp.tanh(nnx.merge(graphdef, st)(x))))(state)
    for impl in ("ragged", "blocked", "pallas"):
        for d, r in zip(jax.tree.leaves(grads["dense"]), jax.tree.leaves(grads[impl])):
            np.testing.assert_allclose(np.asarray(r), np.asarray(d), atol=2e-5 * float(jnp.abs(d).max()), rtol=1e-4)
