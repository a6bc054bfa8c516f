"""EXAONE 4.0 (Exaone4ForCausalLM: EXAONE-4.0-1.2B, -32B): OLMo 2's layer (norms on the attention's and the MLP's
outputs only) with per-head q/k norm; with a sliding window, the global layers attend without RoPE. Config keys as
transformers' Exaone4Config reads them, logits against transformers' class (with and without windows), round trips,
the sampler against full forwards, and the errors that name what differs."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens


def _types(cfg: ModelConfig) -> list[str]:
    return ["sliding_attention" if cfg.layer_window(i) is not None else "full_attention" for i in range(cfg.num_layers)]


@pytest.mark.parametrize("keys", [{}, {"sliding_window": None, "layer_types": ["full_attention"] * 8},
                                  {"sliding_window_pattern": 2}, {"sliding_window": 512, "sliding_window_pattern": 4}])
def test_layer_types_and_rope_read_as_transformers_reads_them(keys):
    transformers = pytest.importorskip("transformers", reason="the reference is transformers' Exaone4Config")
    d = {"model_type": "exaone4", "num_hidden_layers": 8, "max_position_embeddings": 8192, **keys}
    ours = ModelConfig.from_hf_dict(d)
    theirs = transformers.Exaone4Config(**{k: v for k, v in d.items() if k != "model_type"})
    sliding = [t == "sliding_attention" for t in theirs.layer_types] if theirs.sliding_window is not None else [False] * 8
    assert _types(ours) == ["sliding_attention" if s else "full_attention" for s in sliding]
    # Exaone4Attention rotates when the config has no window or the layer slides
    rotates = [theirs.sliding_window is None or s for s in sliding]
    assert [ours.layer_rope(i) != "none" for i in range(8)] == rotates
    assert ours.olmo and ours.qk_norm and not ours.flat_qk_norm and not ours.attention_bias


def test_string_patterns_and_errors():
    ours = ModelConfig.from_hf_dict({"model_type": "exaone4", "num_hidden_layers": 8, "sliding_window_pattern": "LLLG"})
    assert _types(ours) == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
    with pytest.raises(ValueError, match="sliding_window_pattern='LLXG'"):
        ModelConfig.from_hf_dict({"model_type": "exaone4", "sliding_window_pattern": "LLXG"})
    with pytest.raises(ValueError, match="sliding_window is null"):
        ModelConfig.from_hf_dict({"model_type": "exaone4", "num_hidden_layers": 2, "sliding_window": None,
                                  "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="partial_rotary_factor != 1 is not EXAONE 4.0's"):
        ModelConfig.from_hf_dict({"model_type": "exaone4", "rope_parameters": {"rope_type": "default",
                                                                               "partial_rotary_factor": 0.5}})
    with pytest.raises(ValueError, match="no biases"):
        ModelConfig.from_hf_dict({"model_type": "exaone4", "attention_bias": True})
    with pytest.raises(ValueError, match="rotates exactly its sliding layers"):
        testing.tiny_config("exaone4", rope_layers=(1, 1)).to_hf_dict()
    with pytest.raises(ValueError, match="set qk_norm=True"):
        testing.tiny_config("exaone4", qk_norm=False).to_hf_dict()


@pytest.mark.parity
@pytest.mark.parametrize("overrides", [{}, {"sliding_window": None, "layer_types": None, "rope_layers": None},
                                       {"num_layers": 4, "tie_word_embeddings": True,
                                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16}}])
def test_model_matches_transformers_and_round_trips(tmp_path, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("exaone4", **overrides)
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("exaone4", num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10, 11, 12], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
