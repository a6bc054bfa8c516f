"""Apertus (ApertusForCausalLM) against HF transformers (PyTorch, float32): Llama's layer with q/k norms per head, Llama
3's RoPE scaling and an ungated xIELU MLP whose scalars alpha_p, alpha_n are trained and beta, eps (transformers'
buffers) held; logits and round trips both ways (0-d tensors stay 0-d), transformers' own config class (its RoPE
defaults), the activation against transformers' own, no gradient reaching beta or eps, the sampler's decode (dense
cache, pages) against full forwards, the refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.models.layers import xielu
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("apertus", num_layers=3)
    assert cfg.mlp_activation == "xielu" and not cfg.gated_mlp and cfg.qk_norm
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())  # (beta, eps: buffers, not counted)


@pytest.mark.parity
def test_its_config_class(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.ApertusConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        pad_token_id=0)
    ours = ours_of_their_class(tmp_path, transformers.ApertusForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.rope_theta == 12e6 and ours.cfg.rope_scaling["rope_type"] == "llama3"
    assert float(ours.layers[0].mlp.xielu_beta[...]) == 0.5 and ours.layers[0].mlp.xielu_eps[...].shape == ()


@pytest.mark.parity
def test_xielu_equals_transformers_activation():
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    from transformers.activations import XIELUActivation

    act = XIELUActivation(alpha_p_init=0.7, alpha_n_init=0.9, beta=0.5, eps=-1e-6, dtype=torch.float32)
    x = np.linspace(-6, 6, 1001, dtype=np.float32)
    want = act(torch.tensor(x)).detach().numpy()
    got = xielu(jnp.asarray(x), *(jnp.asarray(getattr(act, n).detach().numpy()) for n in ("alpha_p", "alpha_n")),
                jnp.float32(0.5), jnp.float32(-1e-6))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_no_gradient_reaches_beta_or_eps():
    from flax import nnx

    model = random_model(tiny_config("apertus", num_layers=1), seed=2)
    tokens = jnp.asarray(random_tokens(97, (1, 12), seed=3))
    grads = nnx.grad(lambda m: jnp.mean(m(tokens) ** 2))(model)
    mlp = grads.layers[0].mlp
    assert float(jnp.abs(mlp.xielu_alpha_p[...]).max()) > 0 and float(jnp.abs(mlp.xielu_alpha_n[...]).max()) > 0
    assert float(mlp.xielu_beta[...]) == 0.0 and float(mlp.xielu_eps[...]) == 0.0


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("apertus", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    d = {"model_type": "apertus", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 96, "vocab_size": 97}
    assert jax.tree.leaves(ModelConfig.from_hf_dict(d).rope_scaling)  # (its llama3 defaults)
    with pytest.raises(ValueError, match="Apertus has no biases"):
        ModelConfig.from_hf_dict({**d, "mlp_bias": True})
    with pytest.raises(ValueError, match="is not Apertus'"):
        ModelConfig.from_hf_dict({**d, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="HF Apertus has Llama's layer with q/k norms"):
        tiny_config("apertus", qk_norm=False).to_hf_dict()
