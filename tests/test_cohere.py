"""Cohere (CohereForCausalLM: Command R, Aya Expanse) and Cohere 2 (Cohere2ForCausalLM: Command R7B, Command A) against
HF transformers (PyTorch, float32): a parallel block (attention and the MLP from one LayerNorm without a bias),
interleaved RoPE, scaled logits; Cohere 2's sliding layers rotating and its full-attention layers without position
embeddings. Logits and round trips both ways, transformers' own config classes, the sampler's decode (sliding layers
as rings; dense cache, pages) against full forwards, LoRA through PEFT, the refusals."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["cohere", "cohere2"])
def test_logits_match_transformers_and_round_trip(tmp_path, arch):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config(arch, num_layers=4)
    if arch == "cohere2":  # three of four layers slide and rotate; the fourth attends everything without RoPE
        assert [cfg.layer_window(i) for i in range(4)] == [8, 8, 8, None] and cfg.rope_layers == (1, 1, 1, 0)
    model = random_model(cfg, seed=1)
    assert model.layers[0].post_attn_norm is None and model.layers[0].input_norm.bias is None  # one norm, no bias
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))  # 40 positions past 8
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["cohere", "cohere2"])
def test_its_config_class(tmp_path, arch):
    """transformers' CohereConfig / Cohere2Config with their defaults (head_dim hidden_size / heads, tied embeddings,
    logit_scale 1/16, Cohere 2's layer kinds: every fourth full): our logits and fields."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    kind = {"cohere": (transformers.CohereConfig, transformers.CohereForCausalLM),
            "cohere2": (transformers.Cohere2Config, transformers.Cohere2ForCausalLM)}[arch]
    extra = {"sliding_window": 6} if arch == "cohere2" else {}
    config = kind[0](vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256, **extra)
    ours = ours_of_their_class(tmp_path, kind[1], config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.head_dim == 16 and ours.cfg.tie_word_embeddings and ours.cfg.logits_scaling == 16.0
    if arch == "cohere2":
        assert [ours.cfg.layer_window(i) for i in range(5)] == [6, 6, 6, None, 6]
        assert ours.cfg.rope_layers == (1, 1, 1, 0, 1)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("cohere2", num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_parallel_block_by_hand():
    """A Cohere layer is x + attn(n) + mlp(n), n its one LayerNorm of x (mean removed, divided by the deviation,
    times the scale): computed here from the layer's own attention and MLP."""
    import jax
    import jax.numpy as jnp

    from areal_jax.models.layers import dot_attention
    from areal_jax.models.rope import rope_tables

    model = random_model(tiny_config("cohere", num_layers=1), seed=4)
    layer, x = model.layers[0], jax.random.normal(jax.random.PRNGKey(0), (1, 6, 64))
    pos = jnp.arange(6)[None]
    cos, sin = rope_tables(model.cfg, pos)["global"]
    attend = lambda q, k, v, sinks=None: dot_attention(q, k, v, jnp.tril(jnp.ones((1, 6, 6), bool)))  # noqa: E731
    centred = x - x.mean(-1, keepdims=True)
    n = centred / jnp.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5) * layer.input_norm.scale[...]
    want = x + layer._attention(n, cos, sin, attend, False, None) + layer.mlp(n)
    np.testing.assert_allclose(layer(x, cos, sin, attend), want, atol=2e-5)


def test_the_refusals_name_what_to_change():
    d = {"model_type": "cohere2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 4, "intermediate_size": 96, "vocab_size": 97}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.sliding_window == 4096 and cfg.rope_layers == (1, 1, 1, 0) and cfg.logits_scaling == 16.0
    with pytest.raises(ValueError, match="use_qk_norm"):
        ModelConfig.from_hf_dict({**d, "model_type": "cohere", "use_qk_norm": True})
    with pytest.raises(ValueError, match="no attention biases"):
        ModelConfig.from_hf_dict({**d, "attention_bias": True})
    with pytest.raises(ValueError, match="each full_attention or sliding_attention"):
        ModelConfig.from_hf_dict({**d, "layer_types": ["full_attention"] * 3 + ["linear_attention"]})
    with pytest.raises(ValueError, match=r"rotates exactly its sliding layers; set rope_layers=\(1, 1, 1, 0\)"):
        tiny_config("cohere2", num_layers=4, rope_layers=(1, 1, 1, 1)).to_hf_dict()
    with pytest.raises(ValueError, match="HF Cohere has full attention with RoPE in every layer"):
        tiny_config("cohere", sliding_window=8).to_hf_dict()
