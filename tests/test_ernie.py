"""ERNIE 4.5 (Ernie4_5ForCausalLM: ERNIE-4.5-0.3B; Ernie4_5_MoeForCausalLM: ERNIE-4.5-21B-A3B, -300B-A47B): Llama's
layer with RoPE on interleaved pairs, and in the MoE softmax experts picked with a bias plus shared experts between
a start and an end layer. The released shapes as transformers reads them, logits against transformers' classes,
round trips both ways, the sampler against full forwards, and the errors that name what differs."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens


def test_released_shapes_read_as_transformers_reads_them():
    moe = ModelConfig.from_hf_dict({"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe"})
    assert moe.rope_interleave and moe.router_scoring == "softmax" and moe.router_score_bias and moe.norm_topk_prob
    assert (moe.num_experts, moe.num_experts_per_tok, moe.shared_expert_size) == (64, 6, 2 * 1536)
    assert [moe.layer_is_moe(i) for i in range(3)] == [False, True, True] and moe.tie_word_embeddings
    # the model cards: 21B parameters, 3B active (ERNIE-4.5-21B-A3B); 0.36B (ERNIE-4.5-0.3B)
    assert 21e9 < moe.num_params < 22e9 and 3e9 < moe.matmul_params_per_token < 3.2e9
    dense = ModelConfig.from_hf_dict({"model_type": "ernie4_5"})
    assert dense.rope_interleave and dense.head_dim == 128 and round(dense.num_params / 1e9, 2) == 0.36
    every_other = ModelConfig.from_hf_dict({"model_type": "ernie4_5_moe", "num_hidden_layers": 6,
                                            "moe_layer_start_index": 1, "moe_layer_end_index": 4,
                                            "moe_layer_interval": 2})
    assert every_other.moe_layers == (0, 1, 0, 1, 0, 0)
    with pytest.raises(ValueError, match="use_bias=True"):
        ModelConfig.from_hf_dict({"model_type": "ernie4_5", "use_bias": True})
    with pytest.raises(ValueError, match="no such pattern"):
        testing.tiny_config("ernie4_5_moe", num_layers=5, moe_layers=(1, 0, 0, 1, 1)).to_hf_dict()
    with pytest.raises(ValueError, match="rope_interleave .* is ERNIE 4.5's, GLM's, Cohere's and Helium's; HF qwen3 rotates"):
        testing.tiny_config("qwen3", rope_interleave=True).to_hf_dict()
    with pytest.raises(ValueError, match="set rope_interleave=True"):
        testing.tiny_config("ernie4_5", rope_interleave=False).to_hf_dict()


@pytest.mark.parity
@pytest.mark.parametrize("arch,overrides", [("ernie4_5", {}),
                                            ("ernie4_5_moe", {"num_layers": 4, "moe_layers": (0, 1, 0, 1)})])
def test_model_matches_transformers_and_round_trips(tmp_path, arch, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config(arch, **overrides)
    hf = hf_model_of(cfg, seed=1)
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    if arch == "ernie4_5_moe":  # the picking bias: [1, E] in transformers' moe_statics, [E] here
        want = hf.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias.detach().numpy()[0]
        np.testing.assert_array_equal(np.asarray(ours.layers[1].mlp.router_score_bias[...]), want)
        assert np.abs(want).max() > 0.1


@pytest.mark.parametrize("arch,page_size", [("ernie4_5", None), ("ernie4_5_moe", 8)])
def test_sampler_decodes_as_its_full_forward(arch, page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config(arch), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
