"""Jais 2 (Jais2ForCausalLM) against HF transformers (PyTorch, float32): LayerNorms with biases, an ungated relu^2 MLP
(up_proj, down_proj) with biases, biases on q/k/v/o; logits and round trips both ways, transformers' own config class
and its default (Jais-2-8B) parameter count, the sampler's decode (dense cache, pages) against full forwards, the MLP
by hand, the refusals, PEFT adapters."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("jais2", num_layers=3)
    hf = hf_model_of(cfg, seed=1)
    assert all(float(hf.get_parameter(f"model.layers.0.{m}.bias").abs().max()) > 0
               for m in ("mlp.up_proj", "mlp.down_proj", "self_attn.o_proj", "input_layernorm"))
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' Jais2Config (biases on by default, relu^2, untied): our logits and fields; with its defaults
    (Jais-2-8B's shape, built on the meta device) the same parameter count as transformers'."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.Jais2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.Jais2ForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.mlp_bias and ours.cfg.attention_out_bias and not ours.cfg.tie_word_embeddings
    assert ours.cfg.layer_norm and ours.cfg.norm_bias and not ours.cfg.gated_mlp and ours.cfg.mlp_activation == "relu2"
    with torch.device("meta"):
        big = transformers.Jais2ForCausalLM(transformers.Jais2Config())
    eight = ModelConfig.from_hf_dict({"model_type": "jais2"})
    assert eight.num_params == sum(p.numel() for p in big.parameters()) == 8_090_401_280


def test_the_mlp_by_hand():
    """Jais 2's MLP is down(relu(up x + b_up) ** 2) + b_down, computed here in numpy from its own weights."""
    import jax
    import jax.numpy as jnp

    model = random_model(tiny_config("jais2", num_layers=1), seed=4)
    mlp = model.layers[0].mlp
    for name in ("up_bias", "down_bias"):  # (zeros at first: make them count)
        getattr(mlp, name)[...] = jax.random.normal(jax.random.PRNGKey(len(name)), getattr(mlp, name)[...].shape)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (1, 5, 64)))
    h = x @ np.asarray(mlp.up_proj[...]) + np.asarray(mlp.up_bias[...])
    want = np.maximum(h, 0) ** 2 @ np.asarray(mlp.down_proj[...]) + np.asarray(mlp.down_bias[...])
    np.testing.assert_allclose(mlp(jnp.asarray(x)), want, atol=2e-4, rtol=1e-5)
    assert mlp.gate_proj is None and mlp.gate_bias is None


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("jais2", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    d = {"model_type": "jais2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 97}
    cfg = ModelConfig.from_hf_dict({**d, "attention_bias": False, "mlp_bias": False, "layer_norm_eps": 1e-6})
    assert not (cfg.mlp_bias or cfg.attention_bias or cfg.attention_out_bias) and cfg.rms_norm_eps == 1e-6
    with pytest.raises(ValueError, match="is not Jais 2's"):
        ModelConfig.from_hf_dict({**d, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="one attention_bias for q/k/v and o_proj"):
        tiny_config("jais2", attention_out_bias=False).to_hf_dict()
    with pytest.raises(ValueError, match="partial_rotary_factor != 1 is not Jais 2's"):
        ModelConfig.from_hf_dict({**d, "partial_rotary_factor": 0.5})


@pytest.mark.parity
def test_peft_adapters_on_attention_and_the_biased_mlp(tmp_path):
    """Adapters on q, v, up_proj and down_proj (whose biases stay as they are): peft's logits over transformers' model
    equal ours, and the directory reads back."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from areal_jax.testing.hf import assert_peft_round_trip, peft_exported
    from areal_jax.testing.models import write_random_hf_checkpoint

    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, tiny_config("jais2", num_layers=2), seed=0)
    model, lcfg, out = peft_exported(base, tmp_path / "adapter", "q,v,up,down")
    assert_peft_round_trip(out, base, model, lcfg, random_tokens(97, (2, 24), seed=5))
