"""CWM (CwmForCausalLM, Code World Model) against HF transformers (PyTorch, float32): Llama's layer with full attention
in every fourth layer and a sliding window in the others, Llama 3's RoPE scaling; logits and round trips both ways,
transformers' own config class (its defaults for the layer kinds and RoPE), the sampler's decode with the sliding
layers held as rings (dense cache, pages) against full forwards, the refusals."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("cwm", num_layers=4)
    assert [cfg.layer_window(i) for i in range(4)] == [None, 8, 8, 8]
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))  # 40 positions past 8
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' CwmConfig with its defaults for the layer kinds (every fourth from the first full), the RoPE
    (Llama 3's scaling, base 1e6, a pretraining length of 8,192) and the end tokens: our logits and fields."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.CwmConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                    max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.CwmForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert [ours.cfg.layer_window(i) for i in range(5)] == [None, 6, 6, 6, None]
    assert ours.cfg.rope_scaling["rope_type"] == "llama3" and ours.cfg.rope_theta == 1e6
    assert ours.cfg.eos_token_id == (128001, 128008, 128009)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("cwm", num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    d = {"model_type": "cwm", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 4, "intermediate_size": 96, "vocab_size": 97}
    assert ModelConfig.from_hf_dict(d).sliding_window == 8192
    with pytest.raises(ValueError, match="no attention or MLP biases"):
        ModelConfig.from_hf_dict({**d, "attention_bias": True})
    with pytest.raises(ValueError, match="each full_attention or sliding_attention"):
        ModelConfig.from_hf_dict({**d, "layer_types": ["full_attention"] * 3 + ["linear_attention"]})
    with pytest.raises(ValueError, match="HF CWM has Llama's layer"):
        tiny_config("cwm", qk_norm=True).to_hf_dict()
