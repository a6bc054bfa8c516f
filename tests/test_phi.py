"""Phi (PhiForCausalLM: phi-1, phi-1.5, phi-2) against HF transformers (PyTorch, float32): parallel blocks with one
LayerNorm (scale and bias), biases on q/k/v, the attention's output (dense), the MLP (fc1, fc2) and the logits, RoPE
over part of each head; logits and round trips both ways, transformers' own config class (its default rotary share,
0.5), phi-2's parameter count, the sampler's decode (dense cache, pages) against full forwards, the refusals."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config

PHI_2 = {"model_type": "phi", "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 32,
         "intermediate_size": 10240, "vocab_size": 51200, "partial_rotary_factor": 0.4, "max_position_embeddings": 2048,
         "layer_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "gelu_new", "bos_token_id": 50256,
         "eos_token_id": 50256}


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("phi", num_layers=3)
    model = random_model(cfg, seed=0)
    assert model.layers[0].post_attn_norm is None and model.lm_head_bias is not None and cfg.rotary_dim == 6
    hf = hf_model_of(cfg, seed=1)
    assert float(hf.lm_head.bias.abs().max()) > 0
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' PhiConfig with its defaults (half of each head rotating, untied head with a bias)."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.PhiConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.PhiForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.rotary_dim == 8 and ours.cfg.lm_head_bias and not ours.cfg.tie_word_embeddings


def test_phi_2_parameter_count():
    """phi-2's config.json (2,560 wide, 32 layers, 40% of each head rotating): 2,779,683,840 parameters, transformers'
    count of the same config."""
    cfg = ModelConfig.from_hf_dict(PHI_2)
    assert cfg.num_params == 2_779_683_840 and cfg.rotary_dim == 32 and cfg.head_dim == 80


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("phi", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="qk_layernorm"):
        ModelConfig.from_hf_dict({**PHI_2, "qk_layernorm": True})
    with pytest.raises(ValueError, match="is not Phi's"):
        ModelConfig.from_hf_dict({**PHI_2, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="biases on q/k/v, the attention's output, the MLP and the logits"):
        tiny_config("phi", lm_head_bias=False).to_hf_dict()
