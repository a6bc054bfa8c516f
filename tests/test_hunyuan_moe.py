"""Hunyuan MoE (HunYuanMoEV1ForCausalLM: Hunyuan-A13B): Hunyuan dense's attention (per-head q/k norms after RoPE)
with, in every layer, a softmax router over experts of intermediate_size whose top-k weights are renormalised and an
ungated shared MLP. The released config's per-layer lists read as transformers' class builds the model, parameter
counts and logits against transformers' class, round trips both ways, the sampler against full forwards, PEFT
export, and the errors that name what differs."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens

A13B = {  # tencent/Hunyuan-A13B-Instruct's config.json keys that shape the model (its per-layer lists as released)
    "model_type": "hunyuan_v1_moe", "vocab_size": 128167, "hidden_size": 4096, "intermediate_size": 3072,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "num_experts": 64, "moe_topk": [8] * 32, "moe_intermediate_size": [3072] * 32, "num_shared_expert": [1] * 32,
    "use_cla": False, "use_qk_norm": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
    "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32,
                                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": True}


def test_the_released_config_reads_as_transformers_builds_it():
    cfg = ModelConfig.from_hf_dict(A13B)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size, cfg.shared_expert_size) == (64, 8, 3072, 3072)
    assert cfg.moe_layers is None and cfg.norm_topk_prob and cfg.router_scoring == "softmax"
    assert not cfg.shared_expert_gated and not cfg.router_score_bias and cfg.qk_norm
    assert cfg.rope_theta == pytest.approx(1e4 * 1000.0 ** (128 / 126))  # the NTK alpha, as for Hunyuan dense
    # the model card: 80B parameters in all, 13B active
    assert 79e9 < cfg.num_params < 81e9 and 12.5e9 < cfg.matmul_params_per_token + cfg.vocab_size * 4096 < 13.5e9
    for key, value, match in (("moe_topk", [8] * 31 + [4], "different values"),
                              ("num_shared_expert", [2] * 32, "one shared MLP"),
                              ("moe_intermediate_size", [1024] * 32, "all of intermediate_size"),
                              ("use_cla", True, "cross-layer attention"), ("num_experts", 1, "at least two experts")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**A13B, key: value})
    with pytest.raises(ValueError, match="HF Hunyuan MoE has experts of intermediate_size in every layer"):
        testing.tiny_config("hunyuan_v1_moe", moe_intermediate_size=32).to_hf_dict()
    with pytest.raises(ValueError, match="HF Hunyuan MoE has experts of intermediate_size in every layer"):
        testing.tiny_config("hunyuan_v1_moe", shared_expert_size=None, shared_expert_gated=True).to_hf_dict()


def test_parameter_count_is_transformers_own():
    pytest.importorskip("torch", reason="the reference is transformers' model")
    cfg = testing.tiny_config("hunyuan_v1_moe")
    assert cfg.num_params == sum(p.numel() for p in hf_model_of(cfg, seed=0).parameters())


@pytest.mark.parity
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 4, "tie_word_embeddings": True, "num_experts_per_tok": 3}])
def test_model_matches_transformers_and_round_trips(tmp_path, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("hunyuan_v1_moe", **overrides)
    hf = hf_model_of(cfg, seed=1)
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    # the router (mlp.gate.wg) and the shared MLP (mlp.shared_mlp) read from their own names
    np.testing.assert_array_equal(np.asarray(ours.layers[0].mlp.router[...]),
                                  hf.model.layers[0].mlp.gate.wg.weight.detach().numpy().T)
    np.testing.assert_array_equal(np.asarray(ours.layers[1].mlp.shared_expert.down_proj[...]),
                                  hf.model.layers[1].mlp.shared_mlp.down_proj.weight.detach().numpy().T)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("hunyuan_v1_moe"), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
