"""The GLM-4.5 family: Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7: grouped-query attention with q/k/v
biases, optional q/k norm and half of each head rotating, then DeepSeek-V3's experts) and Glm4MoeLiteForCausalLM
(GLM-4.7-Flash: DeepSeek-V3's latent attention and experts, its dense layers listed per layer). Configs as the released
ones and as transformers reads them, logits against transformers' classes, checkpoint round trips both ways, the
sampler against full forwards and a training step's gradients on a 2 x 2 mesh."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.models.config_checks import MLA
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens

GLM_45_AIR = {  # zai-org/GLM-4.5-Air's shape: 46 layers (the first dense), 128 experts of 1408, top 8, one shared
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True,
    "use_qk_norm": False, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "rope_theta": 1000000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329}
GLM_45 = {**GLM_45_AIR, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
          "num_hidden_layers": 92, "n_routed_experts": 160, "first_k_dense_replace": 3, "use_qk_norm": True,
          "routed_scaling_factor": 2.5}


def test_released_configs_read_as_transformers_reads_them():
    air = ModelConfig.from_hf_dict(GLM_45_AIR)
    assert (air.architecture, air.num_kv_heads, air.head_dim, air.rotary_dim, air.rope_dim) == ("glm4_moe", 8, 128,
                                                                                                  64, 64)
    assert air.attention_bias and not air.qk_norm and air.mla is None and air.rope_theta == 1e6
    assert air.router_scoring == "sigmoid" and air.router_score_bias and air.router_groups is None
    assert air.shared_expert_size == 1408 and not air.shared_expert_gated and air.eos_token_id == (151329, 151336,
                                                                                                    151338)
    assert [air.layer_is_moe(i) for i in range(3)] == [False, True, True]
    # The model cards: 106B total / 12B active (Air), 355B / 32B (GLM-4.5), 30B / 3B (GLM-4.7-Flash); active: the
    # weights a token multiplies through in the decoder layers
    for d, (low, high), (act_low, act_high) in ((GLM_45_AIR, (106e9, 107e9), (12e9, 12.5e9)),
                                                (GLM_45, (351e9, 356e9), (32e9, 32.5e9)),
                                                ({"model_type": "glm4_moe_lite"}, (29.5e9, 30.5e9), (3e9, 3.5e9))):
        cfg = ModelConfig.from_hf_dict(d)
        assert low < cfg.num_params < high and act_low < cfg.matmul_params_per_token < act_high, d.get("hidden_size")
    full = ModelConfig.from_hf_dict(GLM_45)
    assert full.qk_norm and full.routed_scaling_factor == 2.5 and [full.layer_is_moe(i) for i in range(4)] == [
        False, False, False, True]
    flash = ModelConfig.from_hf_dict({"model_type": "glm4_moe_lite"})  # transformers' defaults: GLM-4.7-Flash
    assert flash.mla == MLA(768, 512, 192, 64, 256, True) and flash.num_experts == 64 and flash.num_kv_heads == 20
    assert flash.routed_scaling_factor == 1.8 and flash.shared_expert_size == 1536 and not flash.layer_is_moe(0)
    with pytest.raises(ValueError, match="mlp_layer_types must list"):
        ModelConfig.from_hf_dict({"model_type": "glm4_moe_lite", "num_hidden_layers": 3, "mlp_layer_types": ["x"] * 3})
    with pytest.raises(ValueError, match="attention_bias=True is not supported for glm4_moe_lite"):
        ModelConfig.from_hf_dict({"model_type": "glm4_moe_lite", "attention_bias": True})


@pytest.mark.parity
@pytest.mark.parametrize("arch,overrides", [
    ("glm4_moe", {}),                                                   # GLM-4.5: q/k norm, three layers
    ("glm4_moe", {"qk_norm": False, "rotary_dim": None, "router_groups": None}),  # Air's form, every dim rotating
    ("glm4_moe_lite", {"moe_layers": (0, 1, 0)}),                       # GLM-4.7-Flash, a dense layer last too
])
def test_model_matches_transformers_and_round_trips(tmp_path, arch, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config(arch, num_layers=3, **overrides)
    assert_parity_and_round_trips(tmp_path, cfg, hf_model_of(cfg, seed=1), random_tokens(97, (2, 40), seed=2))


@pytest.mark.parametrize("arch,page_size", [("glm4_moe", None), ("glm4_moe", 8), ("glm4_moe_lite", 8)])
def test_sampler_decodes_as_its_full_forward(arch, page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config(arch), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


def test_update_gradients_on_a_2x2_mesh_equal_one_devices():
    from tests.test_trainer import grads_agree_on_one_and_four_devices

    grads = grads_agree_on_one_and_four_devices(testing.tiny_config("glm4_moe"))
    bias = [g for k, g in grads.items() if "router_score_bias" in k]
    assert len(bias) == 1 and not bias[0].any()  # the picking bias gets no gradient
    for name in ("q_proj", "q_bias", "k_norm", "shared_expert", "experts_down", "router"):
        assert any(name in k and np.abs(g).max() > 0 for k, g in grads.items()), name


def test_config_errors_name_the_fields():
    with pytest.raises(ValueError, match="HF glm4_moe has grouped-query attention"):
        testing.tiny_config("glm4_moe", num_kv_heads=4, head_dim=20, rotary_dim=None, attention_bias=False,
                            qk_norm=False, mla=MLA(24, 16, 12, 8, 10)).to_hf_dict()
    with pytest.raises(ValueError, match="HF glm4_moe has a sigmoid router"):
        testing.tiny_config("glm4_moe", router_scoring="softmax", router_score_bias=False,
                            router_groups=None).to_hf_dict()
    with pytest.raises(ValueError, match="HF glm4_moe has dense layers first"):
        testing.tiny_config("glm4_moe", num_layers=3, moe_layers=(1, 0, 1)).to_hf_dict()
