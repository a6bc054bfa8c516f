"""Helium (HeliumForCausalLM: Helium-1 2B) and Ministral (MinistralForCausalLM) against HF transformers (PyTorch,
float32): Llama's layer rotating interleaved pairs (Helium), Mistral's with full or sliding attention per layer
(Ministral); logits and round trips both ways, transformers' own config classes, the sampler's decode (dense cache,
pages; Ministral's sliding layers as rings) against full forwards, the refusals."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["helium", "ministral"])
def test_logits_match_transformers_and_round_trip(tmp_path, arch):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config(arch, num_layers=4)
    if arch == "ministral":
        assert [cfg.layer_window(i) for i in range(4)] == [None, 8, 8, 8]
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))  # 40 positions past 8
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["helium", "ministral"])
def test_its_config_class(tmp_path, arch):
    """transformers' HeliumConfig / MinistralConfig (Ministral's default: every layer sliding over sliding_window)."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    kind = {"helium": (transformers.HeliumConfig, transformers.HeliumForCausalLM),
            "ministral": (transformers.MinistralConfig, transformers.MinistralForCausalLM)}[arch]
    extra = {"sliding_window": 6} if arch == "ministral" else {"pad_token_id": 0}
    config = kind[0](vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256, **extra)
    ours = ours_of_their_class(tmp_path, kind[1], config, random_tokens(101, (2, 40), seed=1))
    if arch == "ministral":
        assert [ours.cfg.layer_window(i) for i in range(3)] == [6, 6, 6] and ours.cfg.layer_types is None
    else:
        assert ours.cfg.rope_interleave and ours.cfg.rms_norm_eps == 1e-8


@pytest.mark.parametrize("arch,page_size", [("helium", None), ("ministral", None), ("ministral", 8)])
def test_sampler_decodes_as_its_full_forward(arch, page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config(arch, num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    d = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4,
         "intermediate_size": 96, "vocab_size": 97}
    with pytest.raises(ValueError, match="mlp_bias: Helium's MLP biases"):
        ModelConfig.from_hf_dict({**d, "model_type": "helium", "mlp_bias": True})
    with pytest.raises(ValueError, match="each full_attention or sliding_attention"):
        ModelConfig.from_hf_dict({**d, "model_type": "ministral", "layer_types": ["conv"] * 4})
    with pytest.raises(ValueError, match="Ministral has no biases"):
        ModelConfig.from_hf_dict({**d, "model_type": "ministral", "attention_bias": True})
    with pytest.raises(ValueError, match="HF Helium has Llama's layer rotating interleaved pairs"):
        tiny_config("helium", rope_interleave=False).to_hf_dict()
