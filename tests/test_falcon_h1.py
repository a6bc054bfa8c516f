"""Falcon-H1 (FalconH1ForCausalLM) against HF transformers (PyTorch, float32): attention and a Mamba-2 mixer side by
side in every layer with each of its multipliers away from 1, the mixer's output norm absent, after or before the gate;
logits and round trips both ways, transformers' own config class, a released-size config's parameter count, the
sampler's decode over a dense cache and over pages (on a tensor axis too) against full forwards, the memory plan's
states, LoRA (merged and through PEFT), the refusals."""
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens, randomize_lora_b
from areal_jax.testing.models import random_model, tiny_config

# Falcon-H1-0.5B's shape (36 layers of 8 query and 2 kv heads of 64 beside 24 Mamba-2 heads of 64, d_ssm 1536, one
# group of 128 states; an MLP of 2048), as its config.json writes it
SMALL = {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "vocab_size": 32784, "hidden_size": 1024,
         "intermediate_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 64, "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 128,
         "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_rms_norm": False,
         "mamba_norm_before_gate": False, "tie_word_embeddings": False, "rope_theta": 1e11,
         "max_position_embeddings": 16384, "embedding_multiplier": 5.656854249492381, "lm_head_multiplier": 0.0390625,
         "key_multiplier": 0.390625, "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375,
         "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.23570226039551587, "mlp_multipliers": [0.8838834764831844,
         0.5859375], "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738]}


@pytest.mark.parity
@pytest.mark.parametrize("mamba", [(4, 24, 16, 2, 4, None), (4, 24, 16, 2, 4, "after_gate"), (4, 24, 16, 1, 4,
                                                                                              "before_gate")])
def test_logits_match_transformers_and_round_trip(tmp_path, mamba):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("falcon_h1", num_layers=3, mamba=mamba)
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.mamba_rms_norm == (mamba[5] is not None)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 80), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.long  # 11 s; the parity tests above set every multiplier away from 1 against transformers
def test_each_multiplier_changes_the_logits():
    """Every multiplier of `tiny_config`'s Falcon-H1 reaches the logits (set back to 1, the logits change), so the
    parity above checks each of them against transformers."""
    cfg = tiny_config("falcon_h1", num_layers=1)
    tokens = jnp.asarray(random_tokens(97, (1, 12), seed=3))
    base = np.asarray(random_model(cfg, seed=0)(tokens))
    scales = cfg.hybrid_scales
    changed = {f: scales._replace(**{f: 1.0 if f != "ssm_parts" else (1.0,) * 5}) for f in scales._fields}
    changed.update({f"ssm_parts[{j}]": scales._replace(ssm_parts=tuple(1.0 if k == j else v for k, v in
                                                                       enumerate(scales.ssm_parts))) for j in range(5)})
    for name, other in changed.items():
        got = np.asarray(random_model(cfg.replace(hybrid_scales=other), seed=0)(tokens))
        assert np.abs(got - base).max() > 1e-3, name
    got = np.asarray(random_model(cfg.replace(embedding_multiplier=1.0), seed=0)(tokens))
    assert np.abs(got - base).max() > 1e-3


@pytest.mark.long  # 15-19 s; every other test here runs the hybrid layers unrolled, tests/test_scan_layers.py the scan
def test_scanned_and_rematerialised_layers_give_the_unrolled_values_and_gradients():
    """The training forward over packed rows (each hybrid layer's attention and mixer see their own segments) as one
    scan over the layers with full rematerialisation: the unrolled loop's values and gradients."""
    import jax
    from flax import nnx

    from areal_jax.models.packed_attention import scannable

    model = random_model(tiny_config("falcon_h1", num_layers=2), seed=1)
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(random_tokens(97, (2, 40), seed=4))
    seg = jnp.asarray(np.repeat([[1, 2, 3, 0]], 10, axis=1).reshape(1, 40).repeat(2, 0), jnp.int32)
    pos = jnp.asarray(np.tile(np.arange(10), 4)[None].repeat(2, 0), jnp.int32)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(2, 40, 64)), jnp.float32)

    def loss(p, scan):
        h = nnx.merge(graphdef, p).hidden(tokens, pos, seg, remat="full" if scan else "none", scan_layers=scan)
        return jnp.sum(h * w * (seg > 0)[..., None])

    assert scannable(model.layers) is not None
    (v0, g0), (v1, g1) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, s) for s in (False, True))
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=5e-5)
    alone = np.asarray(model(tokens[:1, 10:20]))  # the second segment of row 0, from position 0, alone
    np.testing.assert_allclose(np.asarray(model(tokens, pos, seg))[0, 10:20], alone[0], atol=2e-5, rtol=0)


@pytest.mark.parity
def test_its_config_class_and_a_released_shape(tmp_path):
    """transformers' FalconH1Config (the mixer's width from mamba_d_ssm, its head width "auto", the default
    multipliers): our logits; Falcon-H1-0.5B's config.json: our parameter count is transformers' (built without
    memory)."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.FalconH1Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=96, mamba_n_heads=6,
                                         mamba_d_state=16, mamba_n_groups=2, max_position_embeddings=256,
                                         key_multiplier=0.5, mlp_multipliers=[1.5, 0.5])
    ours = ours_of_their_class(tmp_path, transformers.FalconH1ForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.layer_types == ("hybrid", "hybrid") and tuple(ours.cfg.mamba) == (6, 16, 16, 2, 4, None)
    assert ours.cfg.hybrid_scales.key == 0.5 and ours.cfg.hybrid_scales.mlp_gate == 1.5

    small = ModelConfig.from_hf_dict(SMALL)
    assert small.num_layers == 36 and small.cache_entries == 72 and tuple(small.mamba) == (24, 64, 128, 1, 4, None)
    with torch.device("meta"):
        big = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**{
            k: v for k, v in SMALL.items() if k not in ("model_type", "architectures")}))
    assert small.num_params == sum(p.numel() for p in big.parameters())
    assert small.num_params == 521_411_104  # (0.52B)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    """Each layer's keys and values (dense rows or pages) and its mixer's window and state (a cache entry of its own:
    `ModelConfig.state_entry`) through prefill, insert and k-step decode."""
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("falcon_h1", num_layers=3), seed=3)
    assert model.cfg.cache_entries == 6 and [model.cfg.state_entry(i) for i in range(3)] == [3, 4, 5]
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


def test_decode_over_pages_on_a_tensor_axis_and_the_planned_states():
    """On a (fsdp 1, tensor 2) mesh the attention splits by kv heads and the mixer by heads and groups; the sampler's
    decode over pages equals full forwards. The memory plan's cache (`kv_cache_bytes`: each layer's keys and values,
    or pages, and beside them its window and state per slot and standby row) is what the engine allocates, dense and
    paged, on one device and per device of that axis."""
    import jax
    from jax.sharding import Mesh

    from areal_jax.sampler.config import RolloutConfig
    from areal_jax.system.memory import kv_cache_bytes
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward, cache_bytes_laid_out

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tensor"))
    model = random_model(tiny_config("falcon_h1", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=8, mesh=mesh)
    for kv_cache in ("dense", "paged"):
        rollout = RolloutConfig(num_slots=4, group_size=2, max_len=64, standby_rows=2, standby_len=16,
                                kv_cache=kv_cache, page_size=4, kv_pages=40)
        planned = [cache_bytes_laid_out(rollout, model, on) for on in (None, mesh)]
        assert [kv_cache_bytes(model.cfg, rollout, 1), kv_cache_bytes(model.cfg, rollout, 2)] == planned, kv_cache
        assert planned[1] < planned[0]


def test_lora_on_both_mixers_and_the_merged_weights(tmp_path):
    """Adapters on the attention, the mixer's in_proj parts and out_proj and the MLP of every layer: merged into the
    weights they give the adapted logits; peft applies those it can (not out_proj: peft refuses it in this model type,
    and the export says so by name before writing) with our logits, and they read back."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from flax import nnx

    from areal_jax.models import load_hf_checkpoint
    from areal_jax.models.peft_io import save_peft_adapter
    from areal_jax.testing.hf import assert_peft_round_trip, peft_exported
    from areal_jax.testing.models import write_random_hf_checkpoint

    cfg = tiny_config("falcon_h1", num_layers=2)
    assert {s for _, s in lora.model_targets(cfg, lora.LoRAConfig(rank=2, targets="all"))} == {
        "q", "k", "v", "o", "in_z", "in_xbc", "in_dt", "out", "gate", "up", "down"}
    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, cfg, seed=0)
    tokens = random_tokens(97, (2, 24), seed=5)
    model = load_hf_checkpoint(base)
    every = lora.LoRAConfig(rank=2, alpha=6.0, targets="all")
    lora.apply_lora(model, every, rngs=nnx.Rngs(1))
    randomize_lora_b(model, 0.3)
    adapted = np.asarray(model(jnp.asarray(tokens)))
    assert np.abs(adapted - np.asarray(load_hf_checkpoint(base)(jnp.asarray(tokens)))).max() > 1e-2
    merged = np.asarray(lora.merged_model(model, every.scale)(jnp.asarray(tokens)))
    np.testing.assert_allclose(merged, adapted, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="leave 'out' out of lora.targets"):
        save_peft_adapter(model, every, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    model, lcfg, out = peft_exported(base, tmp_path / "adapter", "q,k,v,o,in_z,in_xbc,in_dt,gate,up,down")
    assert_peft_round_trip(out, base, model, lcfg, tokens)


def test_the_refusals_name_what_to_change():
    d = {k: v for k, v in SMALL.items() if k != "architectures"}
    with pytest.raises(ValueError, match="no biases but the convolution's"):
        ModelConfig.from_hf_dict({**d, "projectors_bias": True})
    with pytest.raises(ValueError, match="a clamped time step"):
        ModelConfig.from_hf_dict({**d, "time_step_limit": [0.0, 10.0]})
    with pytest.raises(ValueError, match="must be the mixer's width"):
        ModelConfig.from_hf_dict({**d, "mamba_d_head": 48})
    with pytest.raises(ValueError, match="hybrid layers .* but mamba is None"):
        tiny_config("falcon_h1", mamba=None)
    with pytest.raises(ValueError, match="five of them in ssm_parts"):
        tiny_config("falcon_h1", hybrid_scales=(1.0, 1.0, 1.0, 1.0, 1.0, (1.0, 1.0)))
    with pytest.raises(ValueError, match="are Falcon-H1's"):
        tiny_config("qwen3", hybrid_scales=(1.0,) * 5).to_hf_dict()
    with pytest.raises(ValueError, match="are Falcon-H1's"):
        tiny_config("bamba", layer_types=("hybrid", "full_attention")).to_hf_dict()
    with pytest.raises(ValueError, match="after the gate"):
        tiny_config("bamba", mamba=(4, 32, 16, 2, 4, None)).to_hf_dict()
    with pytest.raises(ValueError, match="HF Falcon-H1 has its multipliers"):
        tiny_config("falcon_h1", hybrid_scales=None).to_hf_dict()


@pytest.mark.long  # 20-40 s; in CI the sampler's tensor-axis test above covers the split layers' decoding
def test_sharded_forward_and_gradients_match_one_device():
    """On a 2 x 2 (fsdp, tensor) mesh, each hybrid layer's attention split by heads and its Mamba-2 mixer (two groups)
    by heads and groups: the cache-free forward over packed rows, its gradients and the cache path as on one device."""
    import jax

    from areal_jax.testing.models import assert_sharded_forward_matches_one_device

    assert_sharded_forward_matches_one_device(tiny_config("falcon_h1", num_layers=2),
                                              jax.make_mesh((2, 2), ("fsdp", "tensor")),
                                              lambda model: model.layers[0].linear_attn.in_proj_xbc)


def test_the_memory_probes_compile_hybrid_layers():
    """The update's memory probes (`trainer.memory`) count Falcon-H1's layers as one kind, "linear" (a stateful mixer,
    here with attention beside it), and compile copies of hybrid layers: attention and mixer both."""
    from areal_jax.trainer.memory import layer_counts, probe_config

    cfg = tiny_config("falcon_h1", num_layers=5)
    assert layer_counts(cfg) == {"linear": 5}
    probe = probe_config(cfg, 2, "linear")
    assert probe.layer_types == ("hybrid", "hybrid") and probe.mamba == cfg.mamba
    model = random_model(probe, seed=0)
    assert model.layers[1].attn is not None and model.layers[1].linear_attn is not None
