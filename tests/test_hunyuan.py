"""Hunyuan dense (HunYuanDenseV1ForCausalLM: Hunyuan-0.5B / 1.8B / 4B / 7B): Llama's layer with per-head q/k norms
applied after RoPE, and the released checkpoints' RoPE base stretched by a fixed NTK alpha. Logits against
transformers' class (from our config and from a config with an alpha), round trips, the sampler against full
forwards, PEFT export, and the errors that name what differs."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens, randomize_torch


def test_config_reads_the_alpha_into_the_base_and_refuses_what_differs():
    alpha = {"model_type": "hunyuan_v1_dense", "head_dim": 128,
             "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 1.0}, "rope_theta": 10000.0}
    cfg = ModelConfig.from_hf_dict(alpha)
    # transformers' ntk_alpha RoPE: base * alpha ** (dim / (dim - 2)), worked by hand: 10000 * 1000 ** (128 / 126)
    assert cfg.rope_scaling is None and cfg.rope_theta == pytest.approx(1.0e4 * 10 ** (3 * 128 / 126), rel=1e-12)
    assert cfg.qk_norm and not cfg.attention_bias and cfg.num_kv_heads == cfg.num_heads  # kv heads default to heads
    with pytest.raises(ValueError, match="without an 'alpha'"):
        ModelConfig.from_hf_dict({"model_type": "hunyuan_v1_dense", "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="biases on the projections"):
        ModelConfig.from_hf_dict({"model_type": "hunyuan_v1_dense", "attention_bias": True})
    with pytest.raises(ValueError, match="set qk_norm=True"):
        testing.tiny_config("hunyuan_v1_dense", qk_norm=False).to_hf_dict()


@pytest.mark.parity
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 4, "tie_word_embeddings": True}])
def test_model_matches_transformers_and_round_trips(tmp_path, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("hunyuan_v1_dense", **overrides)
    hf = hf_model_of(cfg, seed=1)
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    # the norms are on disk under their own names and differ from one
    want = hf.model.layers[0].self_attn.query_layernorm.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(ours.layers[0].attn.q_norm.scale[...]), want)


@pytest.mark.parity
def test_a_checkpoint_with_an_ntk_alpha_matches_transformers(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    d = {k: v for k, v in testing.tiny_config("hunyuan_v1_dense").to_hf_dict().items()
         if k not in ("architectures", "model_type", "rope_parameters", "rope_scaling", "rope_theta")}
    d["rope_parameters"] = {"rope_type": "dynamic", "alpha": 50.0, "rope_theta": 10000.0, "factor": 1.0}
    hf = randomize_torch(transformers.HunYuanDenseV1ForCausalLM(transformers.HunYuanDenseV1Config(**d)).eval(), 3)
    cfg = ModelConfig.from_hf_dict({**d, "model_type": "hunyuan_v1_dense"})
    assert cfg.rope_theta == pytest.approx(1e4 * 50.0 ** (16 / 14))
    # against HF's own frequencies with the alpha (its ntk_alpha type), not ours written back
    assert hf.model.rotary_emb.rope_type == "ntk_alpha"
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("hunyuan_v1_dense"), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
