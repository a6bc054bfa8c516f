"""OLMo Hybrid (OlmoHybridForCausalLM) against HF transformers (PyTorch, float32): logits with and without the doubled
write strength, checkpoint round trips, its config class's defaults, the checkpoint layouts on disk (the norms' and
the convolution's: as transformers writes them, as three pieces of their own lengths, whole), the sampler's decode
against full forwards, and the refusals."""
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
@pytest.mark.parametrize("beta_scale", [2.0, 1.0])
def test_logits_match_transformers_and_round_trip(tmp_path, beta_scale):
    """transformers' class built from the config.json we write (linear_allow_neg_eigval on and off): our logits on
    each attention path, its checkpoint loads as our config, ours loads back in transformers bit-equal; the Gated
    DeltaNet layers are pre-norm (input_layernorm), the attention layers OLMo 3's (norms after)."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("olmo_hybrid", num_layers=4, linear=(2, 4, 8, 12, 4, beta_scale))
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.linear_allow_neg_eigval == (beta_scale == 2.0)
    # atol: as Qwen3.5's, two float32 forms of the chunked delta rule part by up to ~5e-4 at these logits
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 80), seed=2), atol=1e-3)
    assert ours.layers[0].input_norm is not None and ours.layers[0].post_ffn_norm is None  # pre-norm
    assert ours.layers[1].input_norm is None and ours.layers[1].post_ffn_norm is not None  # OLMo 3's
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class_and_the_layouts_on_disk(tmp_path):
    """A checkpoint of transformers' OlmoHybridConfig with its defaults but the sizes (a layer of attention to every
    three of Gated DeltaNet, linear head widths from the hidden size, the doubled write strength) as transformers
    saves it (norms named attention_layer_norm / feedforward_layer_norm, the convolution in equal thirds q_conv1d,
    k_conv1d, v_conv1d) loads with equal logits; so do the pieces cut at q's, k's and v's own lengths (as OLMo-core
    writes them); the write strength matters."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from flax import nnx
    from safetensors.numpy import load_file, save_file

    from areal_jax.models import Transformer, load_hf_checkpoint
    from areal_jax.testing.hf import hf_logits, randomize_torch

    torch.manual_seed(0)
    config = transformers.OlmoHybridConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                           num_attention_heads=4, pad_token_id=0, eos_token_id=2)
    hf = randomize_torch(transformers.OlmoHybridForCausalLM(config).float().eval(), 0)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.attention_layer_norm.weight" in tensors and "model.layers.0.input_layernorm.weight" not in tensors
    pieces = [tensors[f"model.layers.0.linear_attn.{x}_conv1d.weight"].shape[0] for x in "qkv"]
    assert pieces == [64, 64, 64]  # transformers' thirds of 2 * 48 + 96 (not q's, k's and v's 48, 48, 96)
    ours = load_hf_checkpoint(tmp_path)
    cfg = ours.cfg
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.rope_theta == 10000.0
    assert tuple(cfg.linear) == (4, 4, 12, 24, 4, 2.0)
    tokens = random_tokens(101, (2, 40), seed=1)
    want = hf_logits(hf, tokens)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), want, atol=1e-3, rtol=0)
    # the pieces at their own lengths (q 48, k 48, v 96 channels)
    for i in range(3):
        base = f"model.layers.{i}.linear_attn."
        whole = np.concatenate([tensors.pop(f"{base}{x}_conv1d.weight") for x in "qkv"])
        for x, (a, b) in zip("qkv", ((0, 48), (48, 96), (96, 192))):
            tensors[f"{base}{x}_conv1d.weight"] = whole[a:b]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    again = load_hf_checkpoint(tmp_path)
    np.testing.assert_allclose(np.asarray(again(jnp.asarray(tokens))), want, atol=1e-3, rtol=0)
    other = Transformer(cfg.replace(linear=cfg.linear._replace(beta_scale=1.0)), rngs=nnx.Rngs(0))
    nnx.update(other, nnx.state(ours))
    assert np.abs(np.asarray(other(jnp.asarray(tokens))) - want).max() > 1e-2


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    """The dense cache, and pages with the Gated DeltaNet states as ring rows beside them: three prompts, two slots."""
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("olmo_hybrid", num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


def test_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="linear.beta_scale=2.0 is OLMo Hybrid's"):
        tiny_config("qwen3_5_text", num_layers=4, linear=(2, 4, 8, 12, 4, 2.0)).to_hf_dict()
    with pytest.raises(ValueError, match="linear.beta_scale must be a positive number"):
        tiny_config("olmo_hybrid", num_layers=4, linear=(2, 4, 8, 12, 4, 0.0))
    with pytest.raises(ValueError, match="both kinds present"):
        ModelConfig.from_hf_dict({"model_type": "olmo_hybrid", "num_hidden_layers": 2,
                                  "layer_types": ["linear_attention", "linear_attention"]})
    with pytest.raises(ValueError, match="only the default RoPE is supported"):
        ModelConfig.from_hf_dict({"model_type": "olmo_hybrid", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="HF OLMo Hybrid has OLMo 3's attention"):
        tiny_config("olmo_hybrid", num_layers=4, rope_scaling={"rope_type": "linear", "factor": 2.0}).to_hf_dict()
