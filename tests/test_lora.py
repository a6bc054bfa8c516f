"""LoRA adapters: exact base logits at init, gradients only to the adapters (and equal to the chain rule
through the merged weight), adapter sharding on a 4-device mesh, adapter-only hand-off and merged vs
unmerged decoding, config errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import config as config_lib
from areal_jax.models import as_tree, lora
from areal_jax.runtime.mesh import MeshConfig, build_meshes
from areal_jax.sampler import generate_batch
from areal_jax.system.lora_channel import AdapterChannel, sampler_graphdef
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig

VOCAB = 97


def tokens(b=2, t=11, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (b, t)), jnp.int32)


def adapted(arch="qwen2", seed=3, b_std=0.0, **kw):
    model = random_model(tiny_config(arch), seed=seed)
    lcfg = lora.LoRAConfig(**{"rank": 4, "alpha": 8.0, **kw})
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(seed + 1))
    if b_std:
        for _, node in nnx.iter_graph(model):
            if isinstance(node, lora.LoRAProjection):
                key = jax.random.key(100 + node.salt)
                node.lora_b.set_value(b_std * jax.random.normal(key, node.lora_b.shape))
    return model, lcfg


def one_device_mesh():
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_init_logits_equal_base_model_exactly(arch):
    base = random_model(tiny_config(arch), seed=3)
    x = tokens()
    want = np.asarray(base(x))
    model, _ = adapted(arch)
    assert lora.has_lora(model)
    np.testing.assert_array_equal(np.asarray(model(x)), want)


def test_bf16_base_equals_the_base_model_stored_in_bf16():
    x = tokens()
    bf16 = random_model(tiny_config(), seed=3)
    nnx.update(bf16, jax.tree.map(lambda p: p.astype(jnp.bfloat16), nnx.state(bf16, nnx.Param)))
    model, _ = adapted(base_dtype="bfloat16")
    frozen = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(bf16(x)))


def test_projection_and_merge_match_a_numpy_reference():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 5, 4, 6)), rng.normal(size=(4, 6, 7))  # two input axes, like o_proj
    a, b = rng.normal(size=(4, 6, 2)), rng.normal(size=(2, 7))
    want_delta = 0.5 * np.einsum("btij,ijr,ro->bto", x, a, b)
    got = lora.lora_delta(jnp.asarray(x, jnp.float32), jnp.asarray(a), jnp.asarray(b), 0.5, n_in=2)
    np.testing.assert_allclose(np.asarray(got), want_delta, rtol=1e-5, atol=1e-5)
    merged = lora.merge_weight(jnp.asarray(w, jnp.float32), jnp.asarray(a), jnp.asarray(b), 0.5)
    np.testing.assert_allclose(np.asarray(merged), w + 0.5 * np.einsum("ijr,ro->ijo", a, b), rtol=1e-5, atol=1e-5)


def test_merged_model_gives_the_adapted_logits():
    model, lcfg = adapted(b_std=0.3)
    x = tokens()
    plain = lora.merged_model(model, lcfg.scale)
    assert not lora.has_lora(plain)
    moved = np.abs(np.asarray(model(x)) - np.asarray(random_model(tiny_config(), seed=3)(x))).max()
    assert moved > 0.1  # the adapters do change the model
    np.testing.assert_allclose(np.asarray(plain(x)), np.asarray(model(x)), rtol=1e-4, atol=1e-4)


def test_targets_select_projections():
    cfg = lora.LoRAConfig(targets="q,v_proj,re:layers\\.1\\.mlp\\.down_proj")
    assert cfg.target_paths(2) == [(0, "q"), (0, "v"), (1, "q"), (1, "v"), (1, "down")]
    assert len(lora.LoRAConfig(targets="all").target_paths(3)) == 21
    assert lora.LoRAConfig(targets="mlp").target_paths(1) == [(0, "gate"), (0, "up"), (0, "down")]
    model, _ = adapted(targets="attn")
    assert isinstance(model.layers[1].attn.o_proj, lora.LoRAProjection)
    assert isinstance(model.layers[1].mlp.up_proj, nnx.Param)


@pytest.mark.parametrize("key, value, words", [
    ("rank", 0, "lora.rank=0"), ("alpha", -1.0, "lora.alpha=-1.0"), ("dropout", 1.0, "lora.dropout=1.0"),
    ("targets", "q,qq", "'qq' is unknown"), ("targets", "re:(", "not a valid regular expression"),
    ("base_dtype", "float16", "lora.base_dtype"), ("sampler", "fused", "lora.sampler"),
])
def test_config_errors_name_the_key(key, value, words):
    c = config_lib.base_config()
    c.lora.enabled = True
    c.lora[key] = value
    with pytest.raises(config_lib.ConfigError, match=words.replace("(", "\\(").replace(".", "\\.")):
        config_lib.validate(c, check_paths=False)


def test_targets_matching_nothing_fail_before_compiling():
    model = random_model(tiny_config(), seed=0)
    with pytest.raises(ValueError, match="selects no projection"):
        lora.apply_lora(model, lora.LoRAConfig(targets="re:layers\\.9\\..*"), rngs=nnx.Rngs(0))


def test_dropout_is_inverted_and_keyed_by_the_input():
    x = jnp.ones((64, 128), jnp.float32)
    y = lora.dropout_inputs(x, 0.25, salt=3)
    kept = np.asarray(y) != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(lora.dropout_inputs(x, 0.25, salt=3)), np.asarray(y))  # same input
    assert (np.asarray(lora.dropout_inputs(2 * x, 0.25, salt=3)) != 0).tolist() != kept.tolist()
    model, _ = adapted(dropout=0.5, b_std=0.3)
    sampler = nnx.merge(lora.sampler_graphdef(model), nnx.state(model))
    x = tokens()
    assert np.abs(np.asarray(model(x)) - np.asarray(sampler(x))).max() > 1e-3  # training graph drops
    plain = lora.merged_model(model, 2.0)
    np.testing.assert_allclose(np.asarray(sampler(x)), np.asarray(plain(x)), rtol=1e-4, atol=1e-4)


def test_gradients_reach_only_the_adapters_and_follow_the_chain_rule():
    """dL/dB = s A^T dL/dW' and dL/dA = s dL/dW' B^T, with dL/dW' from full fine-tuning of the merged model."""
    model, lcfg = adapted(b_std=0.3)
    trajs = random_trajectories(6, vocab=VOCAB)
    cfg = TrainerConfig(lr=1e-2, micro_batch_tokens=64, logits_chunk=16, loss="ppo")
    lora_tr = Trainer(model, cfg, one_device_mesh(), wrt=nnx.LoRAParam)
    paths = [p for p, _ in nnx.to_flat_state(lora_tr.state.params)]
    assert paths and all(p[-1] in ("lora_a", "lora_b") for p in paths)
    full_tr = Trainer(lora.merged_model(model, lcfg.scale), cfg, one_device_mesh())
    loss_l, g_lora = lora_tr.loss_and_grads(trajs)
    loss_f, g_full = full_tr.loss_and_grads(trajs)
    assert abs(loss_l - loss_f) < 1e-5
    for i, part, attr in [(0, "attn", "q_proj"), (1, "attn", "o_proj"), (1, "mlp", "down_proj")]:
        node = getattr(model.layers[i], part).__getattribute__(attr)
        a, b = np.asarray(node.lora_a[...]), np.asarray(node.lora_b[...])
        n_in = a.ndim - 1
        gw = np.asarray(g_full["layers"][i][part][attr][...]).reshape(int(np.prod(a.shape[:n_in])), -1)
        a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1)
        gl = g_lora["layers"][i][part][attr]
        np.testing.assert_allclose(np.asarray(gl["lora_b"][...]).reshape(b2.shape), lcfg.scale * a2.T @ gw,
                                   rtol=2e-3, atol=1e-6)
        np.testing.assert_allclose(np.asarray(gl["lora_a"][...]).reshape(a2.shape), lcfg.scale * gw @ b2.T,
                                   rtol=2e-3, atol=1e-6)
    frozen_before = jax.device_get(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    adapters_before = jax.device_get(lora_tr.state.params)
    lora_tr.update(trajs)
    after = jax.device_get(lora_tr.params)
    frozen_after = nnx.filter_state(after, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    for x, y in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen_after)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    moved = [np.abs(np.asarray(x) - np.asarray(y)).max()
             for x, y in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(lora_tr.state.params))]
    assert min(moved) > 0
    # The optimizer holds moments for the adapters only.
    n_adapter = sum(x.size for x in jax.tree.leaves(lora_tr.state.params))
    n_opt = sum(x.size for x in jax.tree.leaves(lora_tr.state.opt_state) if x.ndim > 0)
    assert n_opt == 2 * n_adapter


def test_adapters_and_frozen_base_shard_by_logical_axes_on_4_devices():
    assert len(jax.devices()) >= 4
    meshes = build_meshes(MeshConfig(colocated=True, fsdp=2, tensor=2))
    model, _ = adapted()
    tr = Trainer(model, TrainerConfig(), meshes.train_mesh, wrt=nnx.LoRAParam)
    attn, mlp = tr.state.params["layers"][0]["attn"], tr.state.params["layers"][0]["mlp"]
    spec = lambda v: tuple(v.get_value().sharding.spec)  # noqa: E731
    assert spec(attn["q_proj"]["lora_a"]) == ("fsdp", None)  # [embed, rank]
    assert spec(attn["q_proj"]["lora_b"]) == (None, "tensor", None)  # [rank, heads, head_dim]
    assert spec(attn["k_proj"]["lora_b"]) == (None, "tensor", None)  # [rank, kv_heads, head_dim]
    assert spec(attn["o_proj"]["lora_a"]) == ("tensor", None, None)  # [heads, head_dim, rank]
    assert spec(attn["o_proj"]["lora_b"]) == (None, "fsdp")  # [rank, embed]
    assert spec(mlp["down_proj"]["lora_a"]) == ("tensor", None)  # [mlp, rank]
    base = tr._other["layers"][0]["attn"]["q_proj"]["base"]
    assert tuple(base.get_value().sharding.spec) == ("fsdp", "tensor", None)


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_adapter_channel_moves_only_adapter_bytes(mode):
    meshes = build_meshes(MeshConfig(colocated=True, fsdp=2, tensor=2))
    model, lcfg = adapted(b_std=0.3)
    tr = Trainer(model, TrainerConfig(), meshes.train_mesh, wrt=nnx.LoRAParam)
    channel = AdapterChannel(tr.params, meshes.rollout_mesh, scale=lcfg.scale, mode=mode)
    got = channel.publish(1, tr.params)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert channel.last_bytes == adapter_bytes == lora.adapter_bytes(model.cfg, lcfg)
    frozen = jax.tree.leaves(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    assert channel.base_bytes == sum(x.nbytes for x in frozen)
    assert channel.latest()[0] == 1
    x = tokens()
    decoder = nnx.merge(sampler_graphdef(model, mode), as_tree(got))
    np.testing.assert_allclose(np.asarray(decoder(x)), np.asarray(model(x)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_adapter_channel_takes_the_adapters_alone_held_flat_as_the_job_does(mode):
    """The job publishes the trainer's adapters alone, held flat (system.parts.rollout_source): the channel then
    skips splitting the full state and gives, leaf for leaf, what the full adapted state gives; unmerged, that is
    nnx.merge_state of the base and the adapters, in its order."""
    from areal_jax.models import FlatParams
    from areal_jax.system.parts import rollout_source

    meshes = build_meshes(MeshConfig())
    model, lcfg = adapted(b_std=0.3)
    tr = Trainer(model, TrainerConfig(), meshes.train_mesh, wrt=nnx.LoRAParam)
    channel = AdapterChannel(tr.params, meshes.rollout_mesh, scale=lcfg.scale, mode=mode)
    source = rollout_source(tr, channel)["params"]
    assert isinstance(source, FlatParams) and source.treedef == channel._adapter_def  # the fast path
    got, want = channel.reshard(source), channel.reshard(tr.params)
    assert got.treedef == want.treedef
    for a, b in zip(got.leaves, want.leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if mode == "unmerged":
        ref = nnx.merge_state(channel.base, nnx.split_state(tr.params, nnx.LoRAParam, ...)[0])
        assert got.treedef == jax.tree.structure(ref)
        for a, b in zip(got.leaves, jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5_text"])  # Qwen3.5: adapters on its Gated DeltaNet layers too
def test_merged_and_unmerged_decoding_give_the_same_greedy_tokens(arch):
    model, lcfg = adapted(arch, b_std=0.3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, int(n)).tolist() for n in rng.integers(3, 12, 6)]
    unmerged = nnx.merge(lora.sampler_graphdef(model), nnx.state(model))
    merged = lora.merged_model(model, lcfg.scale)
    base = random_model(tiny_config(arch), seed=3)
    kw = dict(max_new_tokens=12, temperature=0.0, num_slots=4)
    a = [list(c.tokens) for c in generate_batch(unmerged, prompts, **kw)]
    b = [list(c.tokens) for c in generate_batch(merged, prompts, **kw)]
    c = [list(c.tokens) for c in generate_batch(base, prompts, **kw)]
    assert a == b
    assert a != c  # the adapters change what is generated


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "lfm2", "granitemoehybrid"])
def test_each_stateful_kind_describes_the_layer_it_builds(arch):
    """`models.mixers.kind`'s names against the layer and cache it builds: adapter_dims are the projections' (inputs,
    outputs) in lora.targets' order, weights() counts the layer's parameters, state_bytes its cache entries' bytes."""
    from areal_jax.models.mixers import kind
    from areal_jax.models.transformer import zero_cache

    overrides = {"num_layers": 3, "mamba": (4, 32, 16, 2, 4),
                 "layer_types": ("linear_attention", "full_attention", "linear_attention")} \
        if arch == "granitemoehybrid" else {}
    cfg = tiny_config(arch, **overrides)
    model = random_model(cfg, seed=0)
    i = next(i for i in range(cfg.num_layers) if cfg.layer_is_linear(i))
    mixer, module = model.layers[i].linear_attn, kind(cfg)
    assert isinstance(mixer, module.Mixer)
    dims = module.adapter_dims(cfg)
    assert tuple(dims) == lora.linear_projections(cfg) == {
        "qwen3_5_text": lora.LINEAR, "qwen3_next": lora.LINEAR, "olmo_hybrid": lora.SPLIT_LINEAR, "lfm2": lora.CONV,
        "granitemoehybrid": lora.MAMBA}[arch]
    for short, (n_in, n_out) in dims.items():
        weight = getattr(mixer, lora.PROJECTIONS[short][1])
        assert (weight.shape[0], int(np.prod(weight.shape[1:]))) == (n_in, n_out), short
    held = sum(x.size for x in jax.tree.leaves(nnx.state(mixer, nnx.Param)))
    matrices, rest = module.weights(cfg)
    assert matrices == sum(a * b for a, b in dims.values()) and matrices + rest == held
    window, state = zero_cache(cfg, 3, [8] * cfg.num_layers).k[i], zero_cache(cfg, 3, [8] * cfg.num_layers).v[i]
    assert module.state_bytes(cfg) == (window.nbytes + state.nbytes) // 3
