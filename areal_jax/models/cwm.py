"""CWM (`CwmForCausalLM`: facebook/cwm, Code World Model): what its config.json means here (`config_from_hf`,
`config_to_hf`, `check_hf`).

Llama's layer (no biases, SwiGLU, RMSNorm, Llama 3's RoPE scaling in every layer) with per-layer attention kinds:
layer_types says which layers attend over the whole context and which over a sliding window of sliding_window
positions (transformers' default: every fourth layer from the first full, the others sliding over 8,192). Its
tensors are named as Llama's.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields, window_kinds, written_kinds

HF_CLASSES = {"cwm": "CwmForCausalLM"}
_DEFAULTS = dict(vocab_size=128256, hidden_size=6144, intermediate_size=21504, num_hidden_layers=64,
                 num_attention_heads=48, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
                 eos_token_id=[128001, 128008, 128009], sliding_window=8192)  # transformers' CwmConfig
_ROPE = {"rope_theta": 1_000_000.0, "factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
         "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # its default rope_parameters


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a CWM config.json (transformers' defaults where a key is absent)."""
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("CWM has no attention or MLP biases; this config.json sets attention_bias / mlp_bias.")
    d = {**d, "rope_parameters": d.get("rope_parameters") or d.get("rope_scaling") or _ROPE}
    fields, get = common_fields(d, model_type, _DEFAULTS, "CWM")
    layers, window = fields["num_layers"], d.get("sliding_window", _DEFAULTS["sliding_window"])
    types = window_kinds(d, layers, ("full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)),
                         "CWM")
    sliding = "sliding_attention" in types and window
    return cls(**fields, sliding_window=int(window) if sliding else None, layer_types=types if sliding else None,
               dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' CwmForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "CWM", "Llama's layer (no biases, no q/k norm, rotary embeddings over every dimension of every "
                   "head) with full or sliding attention per layer", attention_bias=False, qk_norm=False,
                   rotary_dim=None, rope_layers=None, num_experts=0, rope_local_theta=None)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a CWM config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, layer_types=written_kinds(cfg), sliding_window=cfg.sliding_window, mlp_bias=False, pad_token_id=None)
