"""Granite 4.0 with attention layers only (GraniteMoeHybridForCausalLM: granite-4.0-micro) against HF transformers (PyTorch, float32): logits with RoPE and without, round trips, a checkpoint of transformers' own config
class, the granite-4.0-micro config's parameter count, and the refusal of the hybrid checkpoints' Mamba-2 layers and
experts."""
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import tiny_config

# granite-4.0-micro's config.json, as released (its keys of interest)
MICRO = {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 2560,
         "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8, "shared_intermediate_size": 8192,
         "intermediate_size": 8192, "vocab_size": 100352, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
         "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 10.0,
         "rope_theta": 10_000_000.0, "max_position_embeddings": 131072, "layer_types": ["attention"] * 40,
         "position_embedding_type": "rope", "num_local_experts": 0, "rms_norm_eps": 1e-5, "bos_token_id": 100257,
         "eos_token_id": 100257, "pad_token_id": 100256}


@pytest.mark.parity
@pytest.mark.parametrize("rope", [True, False])
def test_logits_match_transformers_and_round_trip(tmp_path, rope):
    """transformers' class built from the config.json we write (position_embedding_type rope, and nope: no layer
    rotates): our logits, its checkpoint loads as our config, ours loads back bit-equal; the shared MLP's fused
    input_linear splits into gate and up."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("granitemoehybrid", num_layers=3, **({} if rope else {"rope_layers": (0, 0, 0)}))
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.position_embedding_type == ("rope" if rope else "nope")
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 30), seed=2))
    fused = hf.model.layers[0].shared_mlp.input_linear.weight.detach().numpy()  # [2F, D]: gate rows, then up
    f = cfg.intermediate_size
    np.testing.assert_array_equal(np.asarray(ours.layers[0].mlp.gate_proj[...]), fused[:f].T)
    np.testing.assert_array_equal(np.asarray(ours.layers[0].mlp.up_proj[...]), fused[f:].T)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class_and_the_micro_config(tmp_path):
    """A checkpoint of transformers' GraniteMoeHybridConfig (layer types "attention", no experts, RoPE) loads with
    equal logits; granite-4.0-micro's config.json reads with transformers' parameter count (3.4B)."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import hf_logits, randomize_torch

    torch.manual_seed(0)
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        shared_intermediate_size=48, num_local_experts=0, layer_types=["attention"] * 3, position_embedding_type="rope",
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=2.0,
        max_position_embeddings=256, mamba_n_heads=4)
    hf = randomize_torch(transformers.GraniteMoeHybridForCausalLM(config).float().eval(), 0)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.cfg.intermediate_size == 48 and ours.cfg.residual_multiplier == 0.22 and ours.cfg.rope_layers is None
    tokens = random_tokens(101, (2, 24), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)

    micro = ModelConfig.from_hf_dict(MICRO)
    with torch.device("meta"):
        model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig.from_dict(MICRO))
    assert micro.num_params == sum(p.numel() for p in model.parameters())
    assert 3.3e9 < micro.num_params < 3.5e9 and micro.rope_theta == 1e7 and micro.tie_word_embeddings


def test_the_hybrid_checkpoints_are_refused_by_name():
    with pytest.raises(ValueError, match="Mamba-2 layers \\(0, 1, 2, 4 of layer_types\\) are not supported"):
        ModelConfig.from_hf_dict({**MICRO, "num_hidden_layers": 5,
                                  "layer_types": ["mamba", "mamba", "mamba", "attention", "mamba"]})
    with pytest.raises(ValueError, match="Mamba-2 layers"):  # transformers' default: every layer Mamba
        ModelConfig.from_hf_dict({"model_type": "granitemoehybrid", "num_local_experts": 0})
    with pytest.raises(ValueError, match="num_local_experts=4: Granite 4.0's experts"):
        ModelConfig.from_hf_dict({**MICRO, "num_local_experts": 4})
    with pytest.raises(ValueError, match="HF Granite 4.0 \\(attention layers only\\) has none of / other: qk_norm"):
        tiny_config("granitemoehybrid", qk_norm=True).to_hf_dict()
