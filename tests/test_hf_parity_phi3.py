"""Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM) against HF transformers (PyTorch, float32): fused qkv_proj and
gate_up_proj, partial rotary embeddings, LongRoPE (short and long factors), the sliding window; checkpoint round
trips, and what the real checkpoints' config.json says."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import Transformer, load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import read_safetensors_dir
from areal_jax.testing.hf import hf_logits, random_tokens, randomize_torch
from areal_jax.testing.models import tiny_config, write_random_hf_checkpoint

torch = pytest.importorskip("torch", reason="parity tests need PyTorch (pip install areal_jax[parity])")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers (areal_jax[parity])")

pytestmark = pytest.mark.parity

SHORT = [1.0, 1.05, 1.2, 1.6, 2.2, 3.1]
LONG = [1.0, 1.9, 3.5, 7.0, 13.0, 25.0]


def _hf_config(**kw):
    """Phi-4-mini's layout at toy size: 3/4 of each head rotates, LongRoPE past 64 positions, tied embeddings."""
    base = dict(vocab_size=101, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=64,
                partial_rotary_factor=0.75, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT,
                                 "long_factor": LONG, "partial_rotary_factor": 0.75,
                                 "original_max_position_embeddings": 64})
    base.update(kw)
    return transformers.Phi3Config(**base)


def _hf_model(path, seed=0, **kw):
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(_hf_config(**kw)).to(torch.float32).eval()
    randomize_torch(model, seed)
    model.save_pretrained(path)
    return model


def test_logits_match_transformers_with_short_and_long_factors(tmp_path):
    """Sequences within original_max_position_embeddings use the short factors (transformers' choice for them); a
    run longer than it loads the long factors (`max_len`), which transformers uses for a longer sequence."""
    hf = _hf_model(tmp_path, seed=1)
    ours = load_hf_checkpoint(tmp_path)
    cfg = ours.cfg
    assert cfg.architecture == "phi3" and cfg.rotary_dim == 12 and cfg.rope_scaling["rope_type"] == "longrope"
    assert not cfg.rope_scaling["use_long_factor"] and cfg.tie_word_embeddings
    tokens = random_tokens(cfg.vocab_size, (2, 40))
    ref = hf_logits(hf, tokens)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    long = load_hf_checkpoint(tmp_path, max_len=256)
    assert long.cfg.rope_scaling["use_long_factor"]
    tokens = random_tokens(cfg.vocab_size, (1, 100), seed=3)  # past 64 positions: transformers takes the long ones
    ref = hf_logits(hf, tokens)
    np.testing.assert_allclose(np.asarray(long(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    assert np.abs(np.asarray(ours(jnp.asarray(tokens))) - ref).max() > 1e-2  # the short factors differ there
    # the partial rotation has teeth: rotating every dimension gives other logits
    full = Transformer(cfg.replace(rotary_dim=None, rope_scaling=None), rngs=nnx.Rngs(0))
    nnx.update(full, nnx.state(ours))
    assert np.abs(np.asarray(full(jnp.asarray(tokens[:, :40]))) - hf_logits(hf, tokens[:, :40])).max() > 1e-2


def test_phi3_mini_4k_layout_default_rope_and_a_window(tmp_path):
    """Phi-3-mini-4k's layout: every dimension rotates with the default RoPE, an untied head and a sliding window over
    every layer (its config says 2047 of 4096)."""
    hf = _hf_model(tmp_path, seed=2, partial_rotary_factor=1.0, tie_word_embeddings=False, sliding_window=7,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ours = load_hf_checkpoint(tmp_path)
    cfg = ours.cfg
    assert cfg.rotary_dim is None and cfg.rope_scaling is None and cfg.sliding_window == 7
    tokens = random_tokens(cfg.vocab_size, (2, 30), seed=4)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_hf_to_ours_to_hf_is_byte_identical_and_loads_back(tmp_path):
    """The fused tensors are split on loading and stacked again on saving: every tensor comes back byte for byte,
    and transformers loads our directory with the same logits and the same config."""
    _hf_model(tmp_path / "hf", seed=3)
    ours = load_hf_checkpoint(tmp_path / "hf")
    save_hf_checkpoint(ours, tmp_path / "ours")
    before, after = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "ours")
    assert before.keys() == after.keys() and "model.layers.0.self_attn.qkv_proj.weight" in after
    for name, tensor in before.items():
        assert tensor.tobytes() == after[name].tobytes(), name
    assert load_hf_checkpoint(tmp_path / "ours").cfg == ours.cfg
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(again).__name__ == "Phi3ForCausalLM"
    assert again.config.rope_parameters["short_factor"] == SHORT and again.config.partial_rotary_factor == 0.75
    tokens = random_tokens(101, (1, 30), seed=2)
    np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(original, tokens))


def test_a_phi3_config_of_ours_loads_in_transformers(tmp_path):
    cfg = tiny_config("phi3", num_layers=2)
    ours = write_random_hf_checkpoint(tmp_path, cfg, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Phi3ForCausalLM"
    tokens = random_tokens(cfg.vocab_size, (2, 30), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_phi_config_layouts():
    """What the real checkpoints' config.json says (the keys that matter), read as transformers reads it."""
    mini = {  # microsoft/Phi-4-mini-instruct (and -reasoning)
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "sliding_window": 262144, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                                                   "long_factor": [2.0] * 48}}
    cfg = ModelConfig.from_hf_dict(mini)
    assert cfg.rotary_dim == 96 and cfg.head_dim == 128 and cfg.sliding_window is None
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert abs(cfg.num_params - 3_836_021_760) < 1  # 3.8B
    assert cfg.for_sequence_length(4096) == cfg and cfg.for_sequence_length(8192).rope_scaling["use_long_factor"]
    phi3_mini_4k = {  # microsoft/Phi-3-mini-4k-instruct
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rope_scaling": None,
        "sliding_window": 2047, "tie_word_embeddings": False, "rope_theta": 10000.0}
    cfg = ModelConfig.from_hf_dict(phi3_mini_4k)
    assert cfg.rotary_dim is None and cfg.rope_scaling is None and cfg.sliding_window == 2047
    with pytest.raises(ValueError, match="short_factor"):
        ModelConfig.from_hf_dict({**mini, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 64,
                                                           "long_factor": [2.0] * 48}})
    with pytest.raises(ValueError, match=r"partial_rotary_factor != 1 is not supported for llama \(Phi-3.s, GLM-4.s"):
        ModelConfig.from_hf_dict({**phi3_mini_4k, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                  "partial_rotary_factor": 0.5})
