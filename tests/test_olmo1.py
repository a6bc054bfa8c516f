"""OLMo (OlmoForCausalLM: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf) against HF transformers (PyTorch, float32): Llama's
layer with LayerNorms that have neither scale nor bias, q, k and v clamped (clip_qkv); logits and round trips both
ways, transformers' own config class, OLMo-1B's and OLMo-7B's parameter counts, the clamp by hand, the sampler's
decode (dense cache, pages) against full forwards, the refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config

OLMO_1B = {"model_type": "olmo", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 8192,
           "num_hidden_layers": 16, "num_attention_heads": 16, "tie_word_embeddings": True, "clip_qkv": None}


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("olmo", num_layers=3)
    model = random_model(cfg, seed=0)
    assert model.layers[0].input_norm.scale is None and model.layers[0].input_norm.bias is None
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.OlmoConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=256, clip_qkv=1.0, pad_token_id=0)
    ours = ours_of_their_class(tmp_path, transformers.OlmoForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.clip_qkv == 1.0 and ours.cfg.layer_norm and ours.cfg.weightless_norms


def test_olmo_1b_and_7b_parameter_counts():
    assert ModelConfig.from_hf_dict(OLMO_1B).num_params == 1_176_764_416
    seven = {**OLMO_1B, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "tie_word_embeddings": False, "clip_qkv": 8.0}
    assert ModelConfig.from_hf_dict(seven).num_params == 6_888_095_744


def test_the_projections_are_clamped():
    model = random_model(tiny_config("olmo", num_layers=1), seed=4)
    attn, x = model.layers[0].attn, jax.random.normal(jax.random.PRNGKey(0), (1, 5, 64)) * 10
    ones, zeros = jnp.ones((1, 5, 16)), jnp.zeros((1, 5, 16))
    q, k, v = attn.qkv(x, ones, zeros)  # (no rotation: cos 1, sin 0)
    want = np.clip(np.einsum("btd,dhe->bthe", np.asarray(x), np.asarray(attn.v_proj[...])), -0.5, 0.5)
    np.testing.assert_allclose(v, want, atol=1e-5)
    assert float(jnp.abs(q).max()) <= 0.5 * attn.query_factor + 1e-6 and float(jnp.abs(k).max()) <= 0.5 + 1e-6


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("olmo", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="OLMo here has no attention biases"):
        ModelConfig.from_hf_dict({**OLMO_1B, "attention_bias": True})
    with pytest.raises(ValueError, match="clip_qkv must be a positive number"):
        tiny_config("olmo", clip_qkv=-1.0)
    with pytest.raises(ValueError, match="clip_qkv .* is OLMo's; HF llama has none"):
        tiny_config("llama", clip_qkv=2.0).to_hf_dict()
