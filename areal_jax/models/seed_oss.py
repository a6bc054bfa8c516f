"""Seed-OSS (`SeedOssForCausalLM`: Seed-OSS-36B-Base / -Instruct): what its config.json means here (`config_from_hf`,
`config_to_hf`, `check_hf`).

The layer is Qwen2's (biases on q/k/v by `attention_bias`, on o_proj by `attention_out_bias`, none in the MLP) with
its own head_dim (128 where hidden_size / heads would be 64 at the released 36B shape). Its config's dropout rates
(`attention_dropout`, `residual_dropout`, 0.1) act only in transformers' training mode; nothing here drops
activations, in training or sampling (the RL update trains without dropout, as the sampler generates).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"seed_oss": "SeedOssForCausalLM"}
_DEFAULTS = dict(vocab_size=155136, hidden_size=4096, intermediate_size=27648, num_hidden_layers=64,
                 num_attention_heads=80, num_key_value_heads=8, head_dim=128, max_position_embeddings=524288,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True, attention_out_bias=False,
                 bos_token_id=0, eos_token_id=2)  # transformers' SeedOssConfig, where a config.json leaves a key out


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Seed-OSS config.json (transformers' defaults where a key is absent)."""
    fields, get = common_fields(d, model_type, _DEFAULTS, "Seed-OSS")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported (the MLP projections here have no bias); the released "
                         "Seed-OSS checkpoints have none.")
    return cls(**fields, attention_bias=bool(get("attention_bias")), attention_out_bias=bool(get("attention_out_bias")),
               dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' SeedOssForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Seed-OSS", "no q/k norm and full-width RoPE in every layer without windows", qk_norm=False,
                   rotary_dim=None, sliding_window=None, rope_layers=None)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Seed-OSS config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, attention_bias=cfg.attention_bias, attention_out_bias=cfg.attention_out_bias,
                   mlp_bias=False, attention_dropout=0.0, residual_dropout=0.0, pad_token_id=None)
