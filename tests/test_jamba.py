"""Jamba (JambaForCausalLM) against HF transformers (PyTorch, float32): Mamba mixers (their time step's input, B and
C normalised) beside attention without position embeddings, dense MLPs or experts in every other layer; logits and
round trips both ways, transformers' own config class, the selective scan against its recurrence token by token
(values, gradients, segments, a carried state), the sampler's decode over a dense cache and over pages (on a tensor
axis too) against full forwards, the memory plan's states, LoRA (merged and through PEFT), the refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens, randomize_lora_b
from areal_jax.testing.models import random_model, tiny_config

# 2 of 4 experts (weights as the softmax gives them) in the second and fourth of four layers
EXPERTS = dict(num_layers=4, num_experts=4, num_experts_per_tok=2, moe_layers=(0, 1, 0, 1))


@pytest.mark.parity
@pytest.mark.parametrize("experts", [False, True])
def test_logits_match_transformers_and_round_trip(tmp_path, experts):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("jamba", **(EXPERTS if experts else {"num_layers": 4}))
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.layers_block_type == ["mamba", "attention", "mamba", "mamba"]
    assert hf.config.layers_num_experts == ([1, 4, 1, 4] if experts else [1] * 4)
    # 90 tokens: the scan's chunks of 64 carry the state from one to the next
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 90), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' JambaConfig (the time step's rank "auto": ceil(hidden_size / 16); attention every third layer
    from the first; no experts): our logits."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.JambaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, attn_layer_period=3,
                                      attn_layer_offset=0, num_experts=1, mamba_d_state=8, max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.JambaForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.layer_types == ("full_attention", "linear_attention", "linear_attention")
    assert tuple(ours.cfg.mamba1) == (128, 8, 4, 4, "scaled", None) and ours.cfg.num_experts == 0


def test_selective_scan_equals_its_recurrence():
    """`selective_scan` over rows of segments (chunks of 8 here, segments crossing them) from a given state: each
    token's output and the last state equal `scan_step` token by token (each segment from a zero state, the first one
    from the given state), and so do the gradients of both with respect to every input."""
    from areal_jax.models.mamba1 import scan_step, selective_scan

    rng = np.random.default_rng(0)
    b, t, i, n = 2, 29, 6, 4
    x, dt = (jnp.asarray(rng.normal(size=(b, t, i)), jnp.float32) for _ in range(2))
    dt = jax.nn.softplus(dt)
    a = -jnp.asarray(rng.uniform(0.5, 2.0, (i, n)), jnp.float32)
    bm, cm = (jnp.asarray(rng.normal(size=(b, t, n)), jnp.float32) for _ in range(2))
    state = jnp.asarray(rng.normal(size=(b, i, n)), jnp.float32)
    seg = np.ones((b, t), np.int32)
    seg[0, 11:], seg[0, 20:], seg[1, 5:] = 2, 3, 2

    def reference(x, dt, a, bm, cm, state):
        ys, h = [], state
        for j in range(t):
            starts = jnp.asarray(seg[:, j] != seg[:, max(j - 1, 0)])[:, None, None]
            h = jnp.where(starts, 0.0, h)
            y, h = scan_step(x[:, j], dt[:, j], a, bm[:, j], cm[:, j], h)
            ys.append(y)
        return jnp.stack(ys, axis=1), h

    def chunked(x, dt, a, bm, cm, state):
        return selective_scan(x, dt, a, bm, cm, jnp.asarray(seg), state, chunk=8)

    args = (x, dt, a, bm, cm, state)
    (y0, h0), (y1, h1) = reference(*args), chunked(*args)
    np.testing.assert_allclose(y1, y0, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(h1, h0, atol=1e-5, rtol=1e-5)
    w = jnp.asarray(rng.normal(size=(b, t, i)), jnp.float32)
    loss = lambda f: lambda *v: jnp.sum(f(*v)[0] * w) + jnp.sum(f(*v)[1])  # noqa: E731
    g0 = jax.grad(loss(reference), argnums=tuple(range(6)))(*args)
    g1 = jax.grad(loss(chunked), argnums=tuple(range(6)))(*args)
    for want, got in zip(g0, g1):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page_size,experts", [(None, False), (8, True)])
def test_sampler_decodes_as_its_full_forward(page_size, experts):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("jamba", **(EXPERTS if experts else {"num_layers": 4})), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


def test_decode_over_pages_on_a_tensor_axis_and_the_planned_states():
    """On a (fsdp 1, tensor 2) mesh the Mamba mixers split by channels (and the attention by kv heads); the sampler's
    decode over pages equals full forwards, and the memory plan's cache (`kv_cache_bytes`) is what the engine
    allocates, on one device and per device of that axis."""
    from jax.sharding import Mesh, PartitionSpec

    from areal_jax.models import shard_params
    from areal_jax.sampler.config import RolloutConfig
    from areal_jax.system.memory import kv_cache_bytes
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward, cache_bytes_laid_out

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tensor"))
    model = random_model(tiny_config("jamba", num_layers=4), seed=3)
    placed = shard_params(random_model(model.cfg, seed=3), mesh).layers[0].linear_attn
    assert placed.in_proj_x[...].sharding.spec == PartitionSpec(None, "tensor")
    assert placed.A_log[...].sharding.spec == PartitionSpec("tensor", None)
    assert placed.out_proj[...].sharding.spec == PartitionSpec("tensor", None)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=8, mesh=mesh)
    rollout = RolloutConfig(num_slots=4, group_size=2, max_len=64, standby_rows=2, standby_len=16, kv_cache="paged",
                            page_size=4, kv_pages=40)
    planned = [cache_bytes_laid_out(rollout, model, on) for on in (None, mesh)]
    assert [kv_cache_bytes(model.cfg, rollout, 1), kv_cache_bytes(model.cfg, rollout, 2)] == planned
    assert planned[1] < planned[0]


@pytest.mark.parity
def test_lora_on_the_mixers_and_experts_merged_and_through_peft(tmp_path):
    """Adapters on every projection (the Mamba mixers' in_proj parts x and z and out_proj) and on the experts: merged
    into the weights they give the adapted logits; peft applies them with our logits (the experts' through
    transformers' stacked feed_forward.experts parameters), and they read back."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from flax import nnx

    from areal_jax.models import load_hf_checkpoint
    from areal_jax.models.peft_io import save_peft_adapter
    from areal_jax.testing.hf import assert_peft_round_trip
    from areal_jax.testing.models import write_random_hf_checkpoint

    cfg = tiny_config("jamba", **EXPERTS)
    assert {s for _, s in lora.model_targets(cfg, lora.LoRAConfig(rank=2, targets="linear"))} == {"in_x", "in_z", "out"}
    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, cfg, seed=0)
    model = load_hf_checkpoint(base)
    lcfg = lora.LoRAConfig(rank=2, alpha=6.0, targets="all,experts")
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(1))
    randomize_lora_b(model, 0.3)
    tokens = random_tokens(97, (2, 24), seed=5)
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert lora.adapter_bytes(cfg, lcfg) == held
    adapted = np.asarray(model(jnp.asarray(tokens)))
    merged = np.asarray(lora.merged_model(model, lcfg.scale)(jnp.asarray(tokens)))
    np.testing.assert_allclose(merged, adapted, atol=2e-5, rtol=0)
    out = save_peft_adapter(model, lcfg, tmp_path / "adapter", base_model_name_or_path=base)
    assert_peft_round_trip(out, base, model, lcfg, tokens)


def test_the_refusals_name_what_to_change():
    d = {"model_type": "jamba", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
         "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 97, "num_experts": 1}
    assert ModelConfig.from_hf_dict(d).mamba1 == (128, 16, 4, 4, "scaled", None)
    with pytest.raises(ValueError, match="no projection or attention biases"):
        ModelConfig.from_hf_dict({**d, "mamba_proj_bias": True})
    with pytest.raises(ValueError, match="offsets must be below their periods"):
        ModelConfig.from_hf_dict({**d, "attn_layer_period": 2, "attn_layer_offset": 2})
    with pytest.raises(ValueError, match="every period-th layer from an offset"):
        tiny_config("jamba", num_layers=4, layer_types=("full_attention", "full_attention", "linear_attention",
                                                        "full_attention")).to_hf_dict()
    with pytest.raises(ValueError, match="mamba1 .Mamba mixers. is Jamba's"):
        tiny_config("bamba", mamba=None, mamba1=(128, 8, 4, 4)).to_hf_dict()
    with pytest.raises(ValueError, match="normalise their time step's input"):
        tiny_config("jamba", mamba1=(128, 8, 4, 4, "plain")).to_hf_dict()
    with pytest.raises(ValueError, match="linear, short_conv and mamba None"):
        tiny_config("jamba", mamba=(4, 32, 16, 2, 4))


@pytest.mark.long  # 20-40 s; in CI the sampler's tensor-axis test above covers the split mixers' decoding
def test_sharded_forward_and_gradients_match_one_device():
    """On a 2 x 2 (fsdp, tensor) mesh the Mamba mixers split by channels and the experts over fsdp by expert
    parallelism: the cache-free forward over packed rows, its gradients and the cache path as on one device."""
    from areal_jax.testing.models import assert_sharded_forward_matches_one_device

    assert_sharded_forward_matches_one_device(tiny_config("jamba", **EXPERTS), jax.make_mesh((2, 2), ("fsdp", "tensor")),
                                              lambda model: model.layers[0].linear_attn.in_proj_x)
