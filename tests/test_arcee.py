"""Arcee (ArceeForCausalLM: AFM-4.5B): Llama's attention with an MLP without gate, down(relu(x @ up) ** 2). Logits and
parameter counts against transformers' class, round trips, the sampler against full forwards, LoRA targets without
the gate, and the errors that name what differs."""
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens


def test_config_and_what_is_refused():
    cfg = ModelConfig.from_hf_dict({"model_type": "arcee"})  # every key from transformers' ArceeConfig defaults
    assert cfg.num_kv_heads == cfg.num_heads and not cfg.qk_norm and not cfg.attention_bias
    # two matrices a layer's MLP (no gate), worked by hand at the defaults' shape
    d, f, layers, vocab = 2560, 18432, 32, 32000
    attn = 4 * d * d
    assert cfg.num_params == layers * (attn + 2 * d * f + 2 * d) + 2 * vocab * d + d
    assert cfg.matmul_params_per_token == layers * (attn + 2 * d * f)
    with pytest.raises(ValueError, match="hidden_act='silu' is not Arcee's \\('relu2'\\)"):
        ModelConfig.from_hf_dict({"model_type": "arcee", "hidden_act": "silu"})
    with pytest.raises(ValueError, match="biases on the projections"):
        ModelConfig.from_hf_dict({"model_type": "arcee", "mlp_bias": True})
    with pytest.raises(ValueError, match="set attention_bias=False, qk_norm=False"):
        testing.tiny_config("arcee", qk_norm=True).to_hf_dict()


def test_lora_leaves_the_missing_gate_out():
    cfg = testing.tiny_config("arcee")
    assert lora.mlp_projections(cfg) == ("up", "down")
    paths = lora.LoRAConfig(targets="all").target_paths(2, attention=lora.attention_projections(cfg),
                                                         mlp=lora.mlp_projections(cfg))
    assert (0, "gate") not in paths and (0, "up") in paths and (1, "down") in paths and len(paths) == 12
    model = lora.apply_lora(testing.random_model(cfg, seed=0), lora.LoRAConfig(targets="mlp"), rngs=nnx.Rngs(0))
    assert model.layers[0].mlp.gate_proj is None and isinstance(model.layers[0].mlp.up_proj, lora.LoRAProjection)


@pytest.mark.parity
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 1, "tie_word_embeddings": True,
                                            "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 16}}])
def test_model_matches_transformers_and_round_trips(tmp_path, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("arcee", **overrides)
    hf = hf_model_of(cfg, seed=1)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    np.testing.assert_array_equal(np.asarray(ours.layers[1].mlp.up_proj[...]),
                                  hf.model.layers[1].mlp.up_proj.weight.detach().numpy().T)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("arcee"), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
