"""EXAONE MoE (ExaoneMoeForCausalLM: K-EXAONE-236B-A23B): EXAONE 4.0's attention (per-head q/k norm, sliding layers,
global layers without RoPE) in Llama's layer, and DeepSeek-V3's mixture of experts (sigmoid scores picked with a bias
within groups, renormalised, times a factor; ungated shared experts; dense layers as `mlp_layer_types` lists them).
Config keys as transformers' ExaoneMoeConfig reads them, parameter counts and logits against transformers' class,
round trips both ways, the sampler against full forwards, and the errors that name what differs."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens

SMALL = {"model_type": "exaone_moe", "num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97,
         "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 8192}


@pytest.mark.parametrize("keys", [{}, {"first_k_dense_replace": 3}, {"n_group": 4, "topk_group": 2},
                                  {"mlp_layer_types": ["dense", "sparse"] * 4, "num_shared_experts": 2},
                                  {"layer_types": ["full_attention"] * 8},  # no sliding layer: none rotates
                                  {"sliding_window_pattern": 2, "routed_scaling_factor": 1.0, "norm_topk_prob": False}])
def test_config_reads_as_transformers_reads_it(keys):
    transformers = pytest.importorskip("transformers", reason="the reference is transformers' ExaoneMoeConfig")
    d = {**SMALL, **keys}
    ours = ModelConfig.from_hf_dict(d)
    theirs = transformers.ExaoneMoeConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert [ours.layer_is_moe(i) for i in range(8)] == [t == "sparse" for t in theirs.mlp_layer_types]
    sliding = [t == "sliding_attention" for t in theirs.layer_types] if theirs.sliding_window is not None else [False] * 8
    assert [ours.layer_window(i) is not None for i in range(8)] == sliding
    assert [ours.layer_rope(i) != "none" for i in range(8)] == [theirs.sliding_window is None or s for s in sliding]
    assert ours.shared_expert_size == theirs.moe_intermediate_size * theirs.num_shared_experts
    assert (ours.router_groups or (1, 1)) == (theirs.n_group, theirs.topk_group)
    assert (ours.routed_scaling_factor, ours.norm_topk_prob) == (theirs.routed_scaling_factor, theirs.norm_topk_prob)
    assert ours.router_scoring == "sigmoid" and ours.router_score_bias and not ours.shared_expert_gated
    assert ours.qk_norm and not ours.flat_qk_norm and not ours.olmo  # EXAONE 4's attention, Llama's norms
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    # written back, the config reads as the same model in both
    again = ours.to_hf_dict()
    assert ModelConfig.from_hf_dict(again) == ours
    back = transformers.ExaoneMoeConfig(**{k: v for k, v in again.items() if k not in ("architectures", "model_type")})
    assert (back.mlp_layer_types, back.layer_types) == (theirs.mlp_layer_types, theirs.layer_types)


def test_parameter_count_is_transformers_own():
    pytest.importorskip("torch", reason="the reference is transformers' model")
    cfg = testing.tiny_config("exaone_moe", num_layers=4)
    hf = hf_model_of(cfg, seed=0)
    # the picking biases are buffers in transformers' model, weights on disk and here
    biases = sum(b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
    assert biases == 3 * 8 and cfg.num_params == sum(p.numel() for p in hf.parameters()) + biases


def test_errors_name_what_differs():
    with pytest.raises(ValueError, match="sigmoid scores with a picking bias"):
        ModelConfig.from_hf_dict({**SMALL, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="mlp_layer_types must list 'dense' or 'sparse' for each of the 8 layers"):
        ModelConfig.from_hf_dict({**SMALL, "mlp_layer_types": ["dense", "sparse"]})
    with pytest.raises(ValueError, match="EXAONE MoE has no biases"):
        ModelConfig.from_hf_dict({**SMALL, "attention_bias": True})
    with pytest.raises(ValueError, match="HF EXAONE MoE has DeepSeek-V3's router"):
        testing.tiny_config("exaone_moe", router_score_bias=False).to_hf_dict()
    with pytest.raises(ValueError, match="not a multiple of 16"):
        testing.tiny_config("exaone_moe", shared_expert_size=24).to_hf_dict()
    with pytest.raises(ValueError, match="rotates exactly its sliding layers"):
        testing.tiny_config("exaone_moe", rope_layers=(1, 1)).to_hf_dict()
    with pytest.raises(ValueError, match="none when no layer slides"):
        testing.tiny_config("exaone_moe", sliding_window=None, layer_types=None, rope_layers=None).to_hf_dict()
    with pytest.raises(ValueError, match="sliding_window=null"):
        ModelConfig.from_hf_dict({**SMALL, "sliding_window": None})


@pytest.mark.parity
@pytest.mark.parametrize("overrides", [
    {"num_layers": 4},  # a dense first layer, a global layer without RoPE, groups that bite
    {"sliding_window": None, "layer_types": None, "rope_layers": (0, 0), "router_groups": None,  # no window:
     "shared_expert_size": 32, "norm_topk_prob": False, "moe_layers": None}])  # no RoPE; experts everywhere, two shared
def test_model_matches_transformers_and_round_trips(tmp_path, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("exaone_moe", **overrides)
    hf = hf_model_of(cfg, seed=1)
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    # the picking bias: beside the gate on disk, in the router's buffer in transformers' model, here read from there
    layer = 1 if cfg.moe_layers else 0
    np.testing.assert_array_equal(np.asarray(ours.layers[layer].mlp.router_score_bias[...]),
                                  hf.model.layers[layer].mlp.gate.e_score_correction_bias.numpy())


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("exaone_moe", num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10, 11, 12], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
