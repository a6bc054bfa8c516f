"""Gemma (GemmaForCausalLM: gemma-2b / 7b, CodeGemma) against HF transformers (PyTorch, float32): Llama's layer in Gemma's
form (norms scaling by 1 + w, a GELU-tanh gated MLP, embeddings times sqrt(hidden_size)) without Gemma 2's extra norms,
windows or soft caps; logits and round trips both ways, transformers' own config class given the released files'
legacy hidden_act "gelu", gemma-2b's and gemma-7b's parameter counts, the sampler's decode (dense cache, pages) against
full forwards, the refusals."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config

GEMMA_2B = {"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
            "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 256000,
            "hidden_act": "gelu", "max_position_embeddings": 8192}


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("gemma", num_layers=3)
    assert cfg.gemma and cfg.norm_offset and not cfg.sandwich_norms and cfg.mlp_activation == "gelu_tanh"
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class_with_the_legacy_activation(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.GemmaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=32, hidden_act="gelu",
                                      max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.GemmaForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.tie_word_embeddings and ours.cfg.head_dim == 32 and ours.cfg.num_kv_heads == 1


def test_gemma_2b_and_7b_parameter_counts():
    assert ModelConfig.from_hf_dict(GEMMA_2B).num_params == 2_506_172_416
    seven = {**GEMMA_2B, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 16}
    assert ModelConfig.from_hf_dict(seven).num_params == 8_537_680_896


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("gemma", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="no attention biases and attends causally"):
        ModelConfig.from_hf_dict({**GEMMA_2B, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="is not Gemma's"):
        ModelConfig.from_hf_dict({**GEMMA_2B, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="no windows or soft caps"):
        tiny_config("gemma", sliding_window=8).to_hf_dict()
