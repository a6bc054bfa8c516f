"""Helium (`HeliumForCausalLM`: Kyutai's Helium-1 2B): what its config.json means here (`config_from_hf`,
`config_to_hf`, `check_hf`).

Llama's layer with RoPE on interleaved pairs (`rope_interleave`; transformers' Helium rotates (x0, x1), (x2, x3), ...)
and no o_proj bias; q/k/v biases where attention_bias says (the released model has none). Names as Llama's. Refused:
MLP biases (mlp_bias).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"helium": "HeliumForCausalLM"}
_DEFAULTS = dict(vocab_size=48000, hidden_size=2560, intermediate_size=7040, num_hidden_layers=24,
                 num_attention_heads=20, num_key_value_heads=20, head_dim=128, max_position_embeddings=4096,
                 rms_norm_eps=1e-8, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # its HeliumConfig


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Helium config.json (transformers' defaults where a key is absent)."""
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias: Helium's MLP biases are not supported here (the released model has none).")
    fields, _ = common_fields(d, model_type, _DEFAULTS, "Helium")
    return cls(**fields, attention_bias=bool(d.get("attention_bias", False)), rope_interleave=True, dtype=dtype,
               param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' HeliumForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Helium", "Llama's layer rotating interleaved pairs of every dimension (no q/k norm, no window, "
                   "no o_proj bias)", rope_interleave=True, rotary_dim=None, qk_norm=False, sliding_window=None,
                   rope_layers=None, attention_out_bias=False, num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Helium config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, attention_bias=cfg.attention_bias, mlp_bias=False, pad_token_id=None)
