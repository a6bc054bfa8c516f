"""OLMo (`OlmoForCausalLM`: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf / -0724-hf): what its config.json means here
(`config_from_hf`, `config_to_hf`, `check_hf`).

Llama's pre-norm layer with LayerNorms that have neither scale nor bias (`ModelConfig.layer_norm`,
`weightless_norms`; epsilon 1e-5, fixed as transformers fixes it) and, where clip_qkv is set, q, k and v clamped to
[-clip_qkv, clip_qkv] right after their projections (`clip_qkv`). Names as Llama's, with no norm tensors at all.
Refused: attention biases.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"olmo": "OlmoForCausalLM"}
_DEFAULTS = dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=50279)  # transformers' OlmoConfig
EPS = 1e-5  # its LayerNorms' epsilon (not a config key)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an OLMo config.json (transformers' defaults where a key is absent)."""
    if d.get("attention_bias"):
        raise ValueError("attention_bias: OLMo here has no attention biases (as the released models).")
    fields, _ = common_fields({**d, "rms_norm_eps": EPS}, model_type, _DEFAULTS, "OLMo")
    clip = d.get("clip_qkv")
    return cls(**fields, clip_qkv=None if clip is None else float(clip), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' OlmoForCausalLM would not load as it is (and clip_qkv elsewhere)."""
    if cfg.architecture not in HF_CLASSES:
        if cfg.clip_qkv is not None:
            raise ValueError(f"clip_qkv (q, k and v clamped) is OLMo's; HF {cfg.architecture} has none. Leave it None.")
        return
    require_fields(cfg, "OLMo", "Llama's layer with unscaled LayerNorms of epsilon 1e-5 (no biases, no q/k norm, no "
                   "window, rotary embeddings over every dimension)", attention_bias=False, qk_norm=False,
                   sliding_window=None, rotary_dim=None, rope_layers=None, num_experts=0, rms_norm_eps=EPS)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an OLMo config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict({k: v for k, v in common.items() if k != "rms_norm_eps"}, clip_qkv=cfg.clip_qkv,
                   attention_bias=False, pad_token_id=None)
