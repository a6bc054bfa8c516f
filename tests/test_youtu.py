"""Youtu-LLM (YoutuForCausalLM) against HF transformers (PyTorch, float32): DeepSeek-V3's latent attention (with its
YaRN) in Llama's layer with a dense MLP in every layer; logits and round trips both ways, transformers' own config
class, the sampler's decode over the latent cache (dense, pages) against full forwards, the refusals."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("youtu", num_layers=3)
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 80), seed=2))  # past YaRN's 64
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' YoutuConfig (queries without a rank, interleaved rotary pairs, tied embeddings): our logits."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.YoutuConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                                      qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
                                      max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.YoutuForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert tuple(ours.cfg.mla) == (None, 16, 16, 8, 12, True) and ours.cfg.tie_word_embeddings


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("youtu", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


def test_the_refusals_name_what_to_change():
    d = {"model_type": "youtu", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 96, "vocab_size": 97}
    assert ModelConfig.from_hf_dict(d).mla == (1536, 512, 128, 64, 128, True)
    with pytest.raises(ValueError, match="no attention biases"):
        ModelConfig.from_hf_dict({**d, "attention_bias": True})
    with pytest.raises(ValueError, match="has multi-head latent attention"):
        tiny_config("youtu", mla=None).to_hf_dict()
