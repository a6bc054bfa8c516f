"""Seed-OSS (SeedOssForCausalLM: Seed-OSS-36B): Qwen2's layer with its own head_dim and an optional o_proj bias.
Logits and parameter counts against transformers' class, round trips, the sampler against full forwards, and
the errors that name what differs."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens


def test_config_as_transformers_reads_it_and_refusals():
    transformers = pytest.importorskip("transformers", reason="the reference is transformers' SeedOssConfig")
    cfg = ModelConfig.from_hf_dict({"model_type": "seed_oss"})  # every key from transformers' defaults
    theirs = transformers.SeedOssConfig()
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)
    assert cfg.attention_bias and not cfg.attention_out_bias and not cfg.qk_norm
    with pytest.raises(ValueError, match="mlp_bias=True"):
        ModelConfig.from_hf_dict({"model_type": "seed_oss", "mlp_bias": True})
    with pytest.raises(ValueError, match="set qk_norm=False"):
        testing.tiny_config("seed_oss", qk_norm=True).to_hf_dict()
    with pytest.raises(ValueError, match="attention_out_bias are gpt-oss's; HF qwen3 has none"):
        testing.tiny_config("qwen3", attention_out_bias=True).to_hf_dict()


@pytest.mark.parity
@pytest.mark.parametrize("overrides", [{}, {"head_dim": 24, "attention_out_bias": False, "num_kv_heads": 1}])
def test_model_matches_transformers_and_round_trips(tmp_path, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("seed_oss", **overrides)
    hf = hf_model_of(cfg, seed=1)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())  # the biases counted as transformers holds them
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("seed_oss"), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
