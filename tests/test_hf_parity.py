"""Parity with HF transformers (PyTorch, float32): logits, checkpoint round trips, bfloat16 compute."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import Transformer, load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.hf_io import read_safetensors_dir
from areal_jax.testing.hf import hf_logits as _hf_logits
from areal_jax.testing.hf import random_tokens as _tokens
from areal_jax.testing.hf import randomize_torch as _randomize_torch
from areal_jax.testing.models import tiny_config, write_random_hf_checkpoint

torch = pytest.importorskip("torch", reason="parity tests need PyTorch (pip install areal_jax[parity])")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers (areal_jax[parity])")

pytestmark = pytest.mark.parity

# Small random configs with odd sizes and grouped-query attention (kv heads < heads).
HF_CONFIGS = {
    # Qwen2: q/k/v bias, head_dim = hidden / heads = 12.
    "qwen2": lambda tied: transformers.Qwen2Config(
        vocab_size=101, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        max_position_embeddings=512),
    # Qwen3: q/k RMSNorm, no bias, explicit head_dim 16 != hidden / heads.
    "qwen3": lambda tied: transformers.Qwen3Config(
        vocab_size=103, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        max_position_embeddings=512),
    # Llama 3: llama3 RoPE frequency scaling (a short original context so every band is exercised).
    "llama": lambda tied: transformers.LlamaConfig(
        vocab_size=107, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=[2, 3],
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16, "rope_theta": 500000.0}),
    # Mistral: Llama's layer without its RoPE scaling, full attention (sliding_window null, as from v0.2 on).
    "mistral": lambda tied: transformers.MistralConfig(
        vocab_size=109, hidden_size=40, intermediate_size=76, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=1, head_dim=12, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        max_position_embeddings=512, sliding_window=None),
}
HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
              "mistral": "MistralForCausalLM"}
CASES = [(arch, tied) for arch in HF_CONFIGS for tied in (False, True)]


def _hf_model(arch, tied, path, seed=0):
    torch.manual_seed(seed)
    cfg = HF_CONFIGS[arch](tied)
    model = getattr(transformers, HF_CLASSES[arch])(cfg).to(torch.float32).eval()
    _randomize_torch(model, seed)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch,tied", CASES)
def test_logits_match_transformers(tmp_path, arch, tied):
    hf = _hf_model(arch, tied, tmp_path, seed=len(arch) + tied)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.cfg.architecture == arch and ours.cfg.tie_word_embeddings == tied
    assert ours.cfg.num_kv_heads < ours.cfg.num_heads
    tokens = _tokens(ours.cfg.vocab_size, (2, 40))
    ref = _hf_logits(hf, tokens)
    got = np.asarray(ours(jnp.asarray(tokens)))
    assert np.abs(ref).max() > 1.0  # outputs far from uniform, so the comparison has teeth
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # Positions far from 0 (where llama3 scaling and large angles matter), given explicitly on both sides.
    positions = np.broadcast_to(np.arange(200, 240, dtype=np.int32), (2, 40))
    ref = _hf_logits(hf, tokens, positions)
    got = np.asarray(ours(jnp.asarray(tokens), jnp.asarray(positions)))
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch, scaling", [
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),  # Qwen2.5's layout
    ("qwen3", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 48, "beta_fast": 16.0,
               "beta_slow": 2.0, "mscale": 1.2, "mscale_all_dim": 0.8}),
    ("qwen3", {"type": "yarn", "factor": 2.0, "attention_factor": 1.3, "truncate": False}),  # old key; no original
])
def test_yarn_rope_scaling_matches_transformers(tmp_path, arch, scaling):
    """YaRN long-context RoPE (Qwen2.5 / Qwen3 past 32k): logits at positions before and far past the pretraining
    length equal transformers', for the default attention factor, the mscale ratio and a given factor."""
    cfg = HF_CONFIGS[arch](False)
    cfg.rope_scaling = cfg.rope_parameters = {**scaling, "rope_theta": 10000.0}
    torch.manual_seed(5)
    hf = _randomize_torch(getattr(transformers, HF_CLASSES[arch])(cfg).to(torch.float32).eval(), 5)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.cfg.rope_scaling["rope_type"] == "yarn"
    tokens = _tokens(ours.cfg.vocab_size, (2, 40), seed=5)
    for start in (0, 300):
        positions = np.broadcast_to(np.arange(start, start + 40, dtype=np.int32), (2, 40))
        ref = _hf_logits(hf, tokens, positions)
        np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens), jnp.asarray(positions))), ref, atol=1e-4,
                                   rtol=0)
    # the scaling has teeth: the same weights under plain RoPE give other logits
    plain = Transformer(dataclasses.replace(ours.cfg, rope_scaling=None), rngs=nnx.Rngs(0))
    nnx.update(plain, nnx.state(ours))
    assert np.abs(np.asarray(plain(jnp.asarray(tokens))) - _hf_logits(hf, tokens)).max() > 1e-2


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("qwen3", False), ("llama", True)])
def test_our_checkpoint_loads_in_transformers(tmp_path, arch, tied):
    cfg = tiny_config(arch, tie_word_embeddings=tied)
    ours = write_random_hf_checkpoint(tmp_path, cfg, seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == HF_CLASSES[arch]
    assert hf.config.tie_word_embeddings == tied
    tokens = _tokens(cfg.vocab_size, (2, 24), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), _hf_logits(hf, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,tied", CASES)
def test_hf_to_ours_to_hf_is_byte_identical(tmp_path, arch, tied):
    _hf_model(arch, tied, tmp_path / "hf", seed=7)
    save_hf_checkpoint(load_hf_checkpoint(tmp_path / "hf"), tmp_path / "ours")
    before, after = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "ours")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert tensor.dtype == after[name].dtype and tensor.shape == after[name].shape, name
        assert tensor.tobytes() == after[name].tobytes(), name
    # The re-saved directory also loads in transformers as the same model.
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = _tokens(again.config.vocab_size, (1, 12), seed=2)
    np.testing.assert_array_equal(_hf_logits(again, tokens), _hf_logits(original, tokens))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bfloat16_compute_stays_close_to_float32(tmp_path, arch):
    hf = _hf_model(arch, False, tmp_path, seed=3)
    tokens = _tokens(hf.config.vocab_size, (2, 32), seed=3)
    ref = _hf_logits(hf, tokens)
    scale = np.abs(ref).max()
    for param_dtype, dtype in [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.bfloat16)]:
        model = load_hf_checkpoint(tmp_path, param_dtype=param_dtype, dtype=dtype)
        got = np.asarray(model(jnp.asarray(tokens)))
        assert got.dtype == np.float32 and np.isfinite(got).all()
        err = np.abs(got - ref)
        assert err.max() < 0.03 * scale, (param_dtype, err.max(), scale)
        # Nearly always the same top token as float32.
        assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9
