"""MiniMax-M2 (MiniMaxM2ForCausalLM: M2, M2.1, M2.5): the released config read as transformers reads it, logits
against transformers' class (q/k norm over all heads, half of each head rotating, sigmoid routing with a picking bias
beside Mixtral's experts), checkpoint round trips both ways, the sampler against full forwards, and the errors that
name what transformers would run otherwise."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens

MINIMAX_M2 = {  # MiniMaxAI/MiniMax-M2's shape: 62 layers of 8 of 256 experts, 64 of 128 dimensions rotating
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064, "hidden_size": 3072,
    "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8,
    "head_dim": 128, "rotary_dim": 64, "num_local_experts": 256, "num_experts_per_tok": 8, "rope_theta": 5000000,
    "scoring_func": "sigmoid", "use_routing_bias": True, "tie_word_embeddings": False,
    "max_position_embeddings": 196608, "rms_norm_eps": 1e-06, "use_mtp": True, "num_mtp_modules": 3}


def test_released_config_reads_as_transformers_reads_it():
    cfg = ModelConfig.from_hf_dict(MINIMAX_M2)
    assert (cfg.architecture, cfg.rotary_dim, cfg.rope_theta, cfg.num_experts, cfg.expert_size) == (
        "minimax_m2", 64, 5e6, 256, 1536)
    assert cfg.qk_norm and cfg.flat_qk_norm and not cfg.attention_bias and cfg.moe_layers is None
    assert cfg.router_scoring == "sigmoid" and cfg.router_score_bias and cfg.norm_topk_prob
    assert cfg.router_groups is None and cfg.routed_scaling_factor == 1.0 and cfg.shared_expert_size is None
    # the model card: 230B parameters in all, 10B active
    assert 228e9 < cfg.num_params < 230e9 and 9.5e9 < cfg.matmul_params_per_token < 10e9
    for key, value, match in (("scoring_func", "softmax", "scores experts with a sigmoid"),
                              ("routed_scaling_factor", 2.0, "renormalised scores alone"),
                              ("shared_intermediate_size", 512, "no shared expert")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**MINIMAX_M2, key: value})
    with pytest.raises(ValueError, match="HF MiniMaxM2 routes by sigmoid scores"):
        testing.tiny_config("minimax_m2", norm_topk_prob=False).to_hf_dict()
    with pytest.raises(ValueError, match="HF MiniMaxM2 has q/k norm"):
        testing.tiny_config("minimax_m2", qk_norm=False).to_hf_dict()


@pytest.mark.parity
@pytest.mark.parametrize("rotary_dim", [8, None])
def test_model_matches_transformers_and_round_trips(tmp_path, rotary_dim):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("minimax_m2", rotary_dim=rotary_dim)
    hf = hf_model_of(cfg, seed=1)
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=3))
    # the picking bias sits beside the gate in transformers' block, and read from there here
    np.testing.assert_array_equal(np.asarray(ours.layers[0].mlp.router_score_bias[...]),
                                  hf.model.layers[0].mlp.e_score_correction_bias.numpy())


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("minimax_m2"), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
