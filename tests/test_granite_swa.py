"""Granite SWA and Granite MoE SWA (GraniteSWAForCausalLM, GraniteMoeSWAForCausalLM) against HF transformers
(PyTorch, float32): Granite's scalars with sliding windows (the first of every four layers full), a sink logit per head
and a RoPE base per layer (0: none); logits and round trips both ways, transformers' own config classes, the sink
worked by hand, the sampler's decode against full forwards, the refusals."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config

_SMALL = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
          "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["granite_swa", "granitemoe_swa"])
def test_logits_match_transformers_and_round_trip(tmp_path, arch):
    """Five layers: full attention without RoPE in the first (layer_rope_theta 0) and with base 10^4 in the last,
    sliding windows of 8 with a base of their own (5 x 10^4) between; 40 tokens, so the windows cut."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config(arch, num_layers=5, rope_layers=(0, 1, 1, 1, 1))
    d = cfg.to_hf_dict()
    assert d["layer_rope_theta"] == [0, 50000.0, 50000.0, 50000.0, 10000.0]
    assert d["layer_types"] == ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
    hf = hf_model_of(cfg, seed=1)
    assert float(hf.get_parameter("model.layers.0.self_attn.sinks").abs().min()) > 0
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["granite_swa", "granitemoe_swa"])
def test_their_config_classes(tmp_path, arch):
    """transformers' own config classes: their default layer kinds (layers 0 and 4 full), one base everywhere, then
    a layer_rope_theta with NoPE full layers; our logits and fields."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    swa = arch == "granite_swa"
    config_class = transformers.GraniteSWAConfig if swa else transformers.GraniteMoeSWAConfig
    model_class = transformers.GraniteSWAForCausalLM if swa else transformers.GraniteMoeSWAForCausalLM
    extra = {} if swa else dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40)
    tokens = random_tokens(97, (2, 30), seed=1)
    config = config_class(**_SMALL, **extra, sliding_window=6, embedding_multiplier=6.0, residual_multiplier=0.3,
                          attention_multiplier=0.1, logits_scaling=3.0)
    ours = ours_of_their_class(tmp_path / "a", model_class, config, tokens)
    kinds = ("full_attention", "sliding_attention", "sliding_attention", "sliding_attention") * 2
    assert ours.cfg.layer_types == kinds[:6] and ours.cfg.sliding_window == 6 and ours.cfg.attention_sinks
    assert ours.cfg.rope_local_theta is None and ours.cfg.rope_layers is None
    assert ours.cfg.attention_multiplier == 0.1 and ours.cfg.num_experts == (0 if swa else 4)
    config = config_class(**_SMALL, **extra, sliding_window=6, layer_rope_theta=[0, 1e4, 1e4, 1e4, 0, 1e4])
    ours = ours_of_their_class(tmp_path / "b", model_class, config, tokens)
    assert ours.cfg.rope_layers == (0, 1, 1, 1, 0, 1) and ours.cfg.rope_theta == 1e4


def test_their_sink_is_a_softmax_with_one_more_key():
    """Granite SWA scales the softmax's output by sigmoid(logsumexp(scores) - sink) (worked here in numpy); gpt-oss'
    sinks, which this model runs, add the sink as one more key of value zero: the same weights, masked keys too."""
    import jax.numpy as jnp

    from areal_jax.models.attention_sinks import sink_softmax

    rng = np.random.default_rng(0)
    scores = rng.normal(size=(2, 2, 3, 5, 7)) * 3  # [B, K, G, T, S]
    scores[..., 5:] = -1e30  # masked keys
    sinks = rng.normal(size=(6,)) * 2  # [H], head h = k * G + g
    sink = sinks.reshape(2, 3)[None, :, :, None]
    lse = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
    plain = np.exp(scores - lse[..., None])
    want = plain * (1 / (1 + np.exp(-(lse - sink))))[..., None]
    got = np.asarray(sink_softmax(jnp.asarray(scores, jnp.float32), jnp.asarray(sinks, jnp.float32)))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
    assert np.all(got.sum(-1) < 1) and np.all(got[..., 5:] == 0)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("granite_swa", num_layers=5, rope_layers=(0, 1, 1, 1, 1)), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_layer_kinds_and_bases_read_and_the_refusals():
    d = {**_SMALL, "model_type": "granite_swa", "num_hidden_layers": 5}
    cfg = ModelConfig.from_hf_dict(d)  # transformers' defaults: window 128, layers 0 and 4 full, sinks
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                               "full_attention") and cfg.sliding_window == 128 and cfg.attention_sinks
    cfg = ModelConfig.from_hf_dict({**d, "layer_rope_theta": [0, 0, 0, 0, 0]})
    assert cfg.rope_layers == (0,) * 5 and cfg.rope_local_theta is None
    cfg = ModelConfig.from_hf_dict({**d, "layer_rope_theta": [0, 7e4, 7e4, 7e4, 0]})  # only the sliding layers rotate
    assert cfg.rope_theta == 7e4 and cfg.rope_local_theta is None and cfg.rope_layers == (0, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="the full ones \\[10000.0\\], the sliding ones \\[20000.0, 30000.0\\]"):
        ModelConfig.from_hf_dict({**d, "layer_rope_theta": [1e4, 2e4, 3e4, 2e4, 1e4]})
    with pytest.raises(ValueError, match="num_hidden_layers=5 needs one per layer"):
        ModelConfig.from_hf_dict({**d, "layer_rope_theta": [1e4] * 4})
    with pytest.raises(ValueError, match="which transformers applies to both bases"):
        ModelConfig.from_hf_dict({**d, "layer_rope_theta": [1e4, 2e4, 2e4, 2e4, 1e4],
                                  "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="has a sink logit per head in every layer; set attention_sinks=True"):
        tiny_config("granite_swa", attention_sinks=False).to_hf_dict()
    with pytest.raises(ValueError, match="are gpt-oss's and Granite SWA's; HF granite has none"):
        tiny_config("granite", attention_sinks=True).to_hf_dict()
