"""StableLM (StableLmForCausalLM: stablelm-2-1_6b, stablelm-zephyr-3b) against HF transformers (PyTorch, float32):
LayerNorms with biases, a quarter of each head rotating, q/k/v biases, a SwiGLU MLP; logits and round trips both ways,
transformers' own config class (its default rotary share), stablelm-2-1_6b's parameter count, the sampler's decode
(dense cache, pages) against full forwards, the refusals."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config

STABLELM_2_1_6B = {"model_type": "stablelm", "vocab_size": 100352, "hidden_size": 2048, "intermediate_size": 5632,
                   "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32, "use_qkv_bias": True,
                   "partial_rotary_factor": 0.25, "max_position_embeddings": 4096, "layer_norm_eps": 1e-5}


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("stablelm", num_layers=3)
    assert cfg.layer_norm and cfg.norm_bias and cfg.rotary_dim == 4 and not cfg.parallel_block
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.StableLmConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.StableLmForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.rotary_dim == 4 and not ours.cfg.attention_bias


def test_stablelm_2_1_6b_parameter_count():
    cfg = ModelConfig.from_hf_dict(STABLELM_2_1_6B)
    assert cfg.num_params == 1_644_515_328 and cfg.rotary_dim == 16 and cfg.attention_bias


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("stablelm", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="qk_layernorm / use_parallel_residual"):
        ModelConfig.from_hf_dict({**STABLELM_2_1_6B, "qk_layernorm": True})
    with pytest.raises(ValueError, match="is not StableLM's"):
        ModelConfig.from_hf_dict({**STABLELM_2_1_6B, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="HF StableLM has Llama's layer with LayerNorms"):
        tiny_config("stablelm", qk_norm=True).to_hf_dict()
