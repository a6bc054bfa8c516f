"""Ministral (`MinistralForCausalLM`: Ministral-8B-Instruct-2410 in transformers' ministral form): what its config.json
means here (`config_from_hf`, `config_to_hf`, `check_hf`).

Mistral's layer (no biases) with per-layer attention kinds: layer_types says which layers slide over sliding_window
positions and which attend over the whole context (transformers' default: every layer slides where sliding_window is
set). Names as Llama's.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields, window_kinds, written_kinds

HF_CLASSES = {"ministral": "MinistralForCausalLM"}
_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # transformers' MinistralConfig
_WINDOW = 4096  # its default sliding_window


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Ministral config.json (transformers' defaults where a key is absent)."""
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: Ministral has no biases (as Mistral).")
    fields, _ = common_fields(d, model_type, _DEFAULTS, "Ministral")
    layers, window = fields["num_layers"], d.get("sliding_window", _WINDOW)
    types = window_kinds(d, layers, ("sliding_attention" if window else "full_attention",) * layers, "Ministral")
    sliding = bool(window) and "sliding_attention" in types
    return cls(**fields, sliding_window=int(window) if sliding else None,
               layer_types=types if sliding and "full_attention" in types else None, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' MinistralForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Ministral", "Mistral's layer (no biases, no q/k norm, rotary embeddings over every dimension "
                   "of every head) with full or sliding attention per layer", attention_bias=False, qk_norm=False,
                   rotary_dim=None, rope_layers=None, num_experts=0, rope_local_theta=None)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Ministral config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, layer_types=written_kinds(cfg), sliding_window=cfg.sliding_window, pad_token_id=None)
