"""Bamba (BambaForCausalLM) against HF transformers (PyTorch, float32): logits and round trips, a checkpoint of its
own config class (attention layers by attn_layer_indices, half of each head rotating), the sampler's decode against
full forwards."""
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("bamba", num_layers=4)
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.attn_layer_indices == [1]
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 80), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' BambaConfig (its mixer's head width from mamba_expand, partial_rotary_factor forced to 0.5)."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import hf_logits, randomize_torch

    torch.manual_seed(0)
    config = transformers.BambaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[2],
                                      mamba_n_heads=8, mamba_d_state=16, max_position_embeddings=256)
    hf = randomize_torch(transformers.BambaForCausalLM(config).float().eval(), 0)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.cfg.layer_types[2] == "full_attention" and ours.cfg.rotary_dim == 8
    assert tuple(ours.cfg.mamba) == (8, 16, 16, 1, 4, "after_gate")
    tokens = random_tokens(101, (2, 40), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("bamba", num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
