"""GPT-NeoX (GPTNeoXForCausalLM: Pythia, GPT-NeoX-20B) against HF transformers (PyTorch, float32): parallel blocks with two
LayerNorms (scales and biases), q/k/v fused per head in query_key_value, RoPE over a quarter of each head, an ungated
MLP with the exact GELU and biases everywhere; logits and round trips both ways, transformers' own config class (its
older rotary_pct / rotary_emb_base keys), Pythia-160M's parameter count, the layer by hand, the sampler's decode
(dense cache, pages) against full forwards, LoRA through PEFT, the refusals."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config

PYTHIA_160M = {"model_type": "gpt_neox", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
               "intermediate_size": 3072, "vocab_size": 50304, "rotary_pct": 0.25, "rotary_emb_base": 10000,
               "max_position_embeddings": 2048, "tie_word_embeddings": False, "use_parallel_residual": True,
               "hidden_act": "gelu", "layer_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 0}


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("gpt_neox", num_layers=3)
    assert cfg.rotary_dim == 4 and cfg.parallel_block and cfg.parallel_mlp_norm
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class_with_the_older_keys(tmp_path):
    """transformers' GPTNeoXConfig given rotary_pct 0.5 and rotary_emb_base 5000 (as Pythia's files say it): our
    logits and fields."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.GPTNeoXConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5,
                                        rotary_emb_base=5000)
    ours = ours_of_their_class(tmp_path, transformers.GPTNeoXForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.rotary_dim == 8 and ours.cfg.rope_theta == 5000 and not ours.cfg.tie_word_embeddings


def test_pythia_160m_parameter_count():
    """Pythia-160M's config.json (older keys, untied embed_in / embed_out): 162,322,944 parameters, transformers'
    count of the same config."""
    cfg = ModelConfig.from_hf_dict(PYTHIA_160M)
    assert cfg.num_params == 162_322_944 and cfg.rotary_dim == 16 and cfg.head_dim == 64 and cfg.num_kv_heads == 12


def test_the_parallel_block_by_hand():
    """A GPT-NeoX layer is x + attn(ln1(x)) + mlp(ln2(x)), each LayerNorm (mean removed, divided by the deviation)
    times its scale plus its bias: computed here from the layer's own pieces, every bias drawn."""
    import jax
    import jax.numpy as jnp

    from areal_jax.models.layers import dot_attention
    from areal_jax.models.rope import rope_tables

    model = random_model(tiny_config("gpt_neox", num_layers=1), seed=4)
    layer = model.layers[0]
    for norm in (layer.input_norm, layer.post_attn_norm):
        norm.bias[...] = jax.random.normal(jax.random.PRNGKey(7), norm.bias[...].shape)
    x, pos = jax.random.normal(jax.random.PRNGKey(0), (1, 6, 64)), jnp.arange(6)[None]
    cos, sin = rope_tables(model.cfg, pos)["global"]
    attend = lambda q, k, v, sinks=None: dot_attention(q, k, v, jnp.tril(jnp.ones((1, 6, 6), bool)))  # noqa: E731

    def ln(norm, y):
        c = y - y.mean(-1, keepdims=True)
        return c / jnp.sqrt((c ** 2).mean(-1, keepdims=True) + 1e-5) * norm.scale[...] + norm.bias[...]

    want = x + layer._attention(ln(layer.input_norm, x), cos, sin, attend, False, None) + \
        layer.mlp(ln(layer.post_attn_norm, x))
    np.testing.assert_allclose(layer(x, cos, sin, attend), want, atol=2e-5)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("gpt_neox", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


@pytest.mark.parity
def test_peft_adapters_on_the_fused_attention_and_the_mlp(tmp_path):
    """Adapters on q, k, v (one fused query_key_value, its rows interleaved head by head), o and the MLP: peft's logits
    over transformers' model equal ours, and the directory reads back."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from areal_jax.testing.hf import assert_peft_round_trip, peft_exported
    from areal_jax.testing.models import write_random_hf_checkpoint

    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, tiny_config("gpt_neox", num_layers=2), seed=0)
    model, lcfg, out = peft_exported(base, tmp_path / "adapter", "q,k,v,o,up,down")
    assert_peft_round_trip(out, base, model, lcfg, random_tokens(97, (2, 24), seed=5))


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="use_parallel_residual=false"):
        ModelConfig.from_hf_dict({**PYTHIA_160M, "use_parallel_residual": False})
    with pytest.raises(ValueError, match="is not GPT-NeoX's"):
        ModelConfig.from_hf_dict({**PYTHIA_160M, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="rotates 1 of each head's 64 dimensions"):
        ModelConfig.from_hf_dict({**PYTHIA_160M, "rotary_pct": 1 / 64})
    with pytest.raises(ValueError, match="one key/value head per query head"):
        tiny_config("gpt_neox", num_kv_heads=2).to_hf_dict()
