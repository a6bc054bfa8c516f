"""Nemotron (NemotronForCausalLM) against HF transformers (PyTorch, float32): LayerNorm1P norms (1 + w, and a bias), an
ungated relu^2 MLP, RoPE over half of each head, optional biases; logits and round trips both ways, transformers' own
config class and its default (Nemotron-3-8B-shaped) parameter count, the norm by hand, the sampler's decode against
full forwards, the refusals."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
@pytest.mark.parametrize("biases", [False, True], ids=["released", "biases"])
def test_logits_match_transformers_and_round_trip(tmp_path, biases):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    extra = dict(attention_bias=True, attention_out_bias=True, mlp_bias=True) if biases else {}
    cfg = tiny_config("nemotron", num_layers=3, **extra)
    hf = hf_model_of(cfg, seed=1)
    assert float(hf.get_parameter("model.layers.0.input_layernorm.bias").abs().max()) > 0
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' NemotronConfig (relu^2, half of each head rotating, no biases): our logits and fields; with its
    defaults (built on the meta device) the same parameter count as transformers'."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.NemotronConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.NemotronForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.rotary_dim == 8 and ours.cfg.norm_offset and ours.cfg.norm_bias and not ours.cfg.gated_mlp
    assert not (ours.cfg.attention_bias or ours.cfg.mlp_bias) and ours.cfg.mlp_activation == "relu2"
    with torch.device("meta"):  # (its class needs num_key_value_heads given: absent, it is None there; here, the heads)
        big = transformers.NemotronForCausalLM(transformers.NemotronConfig(num_key_value_heads=48))
    default = ModelConfig.from_hf_dict({"model_type": "nemotron"})
    assert default.num_params == sum(p.numel() for p in big.parameters())


def test_the_norm_by_hand():
    """LayerNorm1P: (x - mean) / sqrt(var + eps) * (1 + w) + b, computed here in numpy from the layer's own weights."""
    import jax.numpy as jnp

    model = random_model(tiny_config("nemotron", num_layers=1), seed=4)
    norm = model.layers[0].input_norm
    x = np.random.default_rng(0).normal(size=(2, 5, 64)).astype(np.float32) * 3 + 1
    centred = x - x.mean(-1, keepdims=True)
    want = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5) * (1 + np.asarray(norm.scale[...])) \
        + np.asarray(norm.bias[...])
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("nemotron", num_layers=2, mlp_bias=True), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    d = {"model_type": "nemotron", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 97}
    cfg = ModelConfig.from_hf_dict({**d, "partial_rotary_factor": 0.25, "norm_eps": 1e-6})
    assert cfg.rotary_dim == 4 and cfg.rms_norm_eps == 1e-6
    with pytest.raises(ValueError, match="is not Nemotron's"):
        ModelConfig.from_hf_dict({**d, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="one attention_bias for q/k/v and o_proj"):
        tiny_config("nemotron", attention_bias=True).to_hf_dict()
