"""Arcee (`ArceeForCausalLM`: AFM-4.5B-Base / AFM-4.5B): what its config.json means here (`config_from_hf`,
`config_to_hf`, `check_hf`).

The layer is Llama's but for the MLP, which has no gate: down(relu(x @ up) ** 2) (hidden_act "relu2"; `layers.MLP`
without gate_proj: `ModelConfig.gated_mlp`, so LoRA's "gate" target and the MLP's parameter count leave it out). Biases are
refused.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"arcee": "ArceeForCausalLM"}
_DEFAULTS = dict(vocab_size=32000, hidden_size=2560, intermediate_size=18432, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=128000, eos_token_id=128001)  # transformers' ArceeConfig, where a config.json leaves a key out


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an Arcee config.json (transformers' defaults where a key is absent)."""
    fields, _ = common_fields(d, model_type, _DEFAULTS, "Arcee", act="relu2")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: biases on the projections are not supported; the released "
                         "Arcee checkpoints have none.")
    return cls(**fields, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' ArceeForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Arcee", "Llama's attention: no biases or q/k norm, full-width RoPE in every layer, no windows",
                   attention_bias=False, qk_norm=False, rotary_dim=None, sliding_window=None, rope_layers=None)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an Arcee config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, hidden_act="relu2", attention_bias=False, mlp_bias=False, pad_token_id=None)
