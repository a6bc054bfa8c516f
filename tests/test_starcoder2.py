"""StarCoder2 (Starcoder2ForCausalLM) against HF transformers (PyTorch, float32): LayerNorms with biases, an ungated GELU
MLP (c_fc, c_proj) with biases, biases on q/k/v/o, a sliding window in every layer; logits and round trips both
ways, transformers' own config class, the sampler's decode (dense cache, pages) against full forwards, the MLP by
hand, the refusals."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("starcoder2", num_layers=3)
    hf = hf_model_of(cfg, seed=1)
    assert all(float(hf.get_parameter(f"model.layers.0.mlp.{m}.bias").abs().max()) > 0 for m in ("c_fc", "c_proj"))
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))  # 40 positions past 8
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' Starcoder2Config with its defaults (use_bias, tied embeddings, GELU-tanh, no window): our logits
    and fields, and its parameter count."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.Starcoder2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.Starcoder2ForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.mlp_bias and ours.cfg.attention_out_bias and ours.cfg.tie_word_embeddings
    assert ours.cfg.sliding_window is None and not ours.cfg.gated_mlp and ours.cfg.mlp_activation == "gelu_tanh"
    assert ours.cfg.num_params == sum(p.numel() for p in transformers.Starcoder2ForCausalLM(config).parameters())


def test_the_mlp_by_hand():
    """StarCoder2's MLP is c_proj(gelu_tanh(c_fc x + b_fc)) + b_proj, computed here in numpy from its own weights."""
    import jax
    import jax.numpy as jnp

    model = random_model(tiny_config("starcoder2", num_layers=1), seed=4)
    mlp = model.layers[0].mlp
    for name in ("up_bias", "down_bias"):  # (zeros at first: make them count)
        getattr(mlp, name)[...] = jax.random.normal(jax.random.PRNGKey(len(name)), getattr(mlp, name)[...].shape)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (1, 5, 64)))
    h = x @ np.asarray(mlp.up_proj[...]) + np.asarray(mlp.up_bias[...])
    gelu = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
    want = gelu @ np.asarray(mlp.down_proj[...]) + np.asarray(mlp.down_bias[...])
    np.testing.assert_allclose(mlp(jnp.asarray(x)), want, atol=2e-5, rtol=1e-5)
    assert mlp.gate_proj is None and mlp.gate_bias is None


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("starcoder2", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    d = {"model_type": "starcoder2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 97}
    cfg = ModelConfig.from_hf_dict({**d, "use_bias": False, "sliding_window": 16})
    assert not (cfg.mlp_bias or cfg.attention_bias or cfg.attention_out_bias) and cfg.sliding_window == 16
    with pytest.raises(ValueError, match="is not StarCoder2's"):
        ModelConfig.from_hf_dict({**d, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="one use_bias for q/k/v, o_proj and the MLP"):
        tiny_config("starcoder2", mlp_bias=False).to_hf_dict()
    with pytest.raises(ValueError, match="mlp_bias .* is StarCoder2's, GPT-NeoX's, Phi's, Jais 2's and Nemotron's; HF llama has none"):
        tiny_config("llama", mlp_bias=True).to_hf_dict()


@pytest.mark.parity
def test_peft_adapters_on_attention_and_the_biased_mlp(tmp_path):
    """Adapters on q, v, c_fc and c_proj (whose biases stay as they are): peft's logits over transformers' model equal
    ours, and the directory reads back."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from areal_jax.testing.hf import assert_peft_round_trip, peft_exported
    from areal_jax.testing.models import write_random_hf_checkpoint

    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, tiny_config("starcoder2", num_layers=2), seed=0)
    model, lcfg, out = peft_exported(base, tmp_path / "adapter", "q,v,up,down")
    assert_peft_round_trip(out, base, model, lcfg, random_tokens(97, (2, 24), seed=5))
