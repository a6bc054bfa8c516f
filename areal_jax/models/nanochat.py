"""NanoChat (`NanoChatForCausalLM`: karpathy/nanochat-d20, -d32): what its config.json means here (`config_from_hf`,
`config_to_hf`, `check_hf`) and its tensors' names (`hf_name`).

Llama's pre-norm layer with every RMSNorm unscaled (`ModelConfig.weightless_norms`; the embeddings are normalised too,
before the first layer), queries and keys normalised (unscaled) after RoPE, whose pairs turn the other way (sin
negated: its rotate_half is (x2, -x1)), an ungated MLP fc2(relu(fc1 x)^2), no biases, logits soft-capped by
final_logit_softcapping, an untied output matrix by default.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, rename, require_fields

HF_CLASSES = {"nanochat": "NanoChatForCausalLM"}
_DEFAULTS = dict(vocab_size=50304, hidden_size=768, intermediate_size=8192, num_hidden_layers=12,
                 num_attention_heads=6, num_key_value_heads=None, max_position_embeddings=2048, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                 final_logit_softcapping=15.0)  # transformers' NanoChatConfig
_NAMES = ((".mlp.up_proj.", ".mlp.fc1."), (".mlp.down_proj.", ".mlp.fc2."))


def hf_name(name: str, cfg: Any = None) -> str:
    """NanoChat's name of a tensor the weight table names as Llama's (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a NanoChat config.json (transformers' defaults where a key is absent)."""
    if d.get("attention_bias"):
        raise ValueError("NanoChat has no attention biases; this config.json sets attention_bias.")
    fields, get = common_fields(d, model_type, _DEFAULTS, "NanoChat", act="relu2")
    cap = get("final_logit_softcapping")
    return cls(**fields, qk_norm=True, final_logit_softcap=None if cap is None else float(cap), dtype=dtype,
               param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' NanoChatForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "NanoChat", "Llama's layer with unscaled q/k norms (no biases, no windows, every dimension "
                   "rotating, no experts) and no soft cap on attention scores", qk_norm=True, attention_bias=False,
                   sliding_window=None, rotary_dim=None, rope_layers=None, num_experts=0, attn_logit_softcap=None)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a NanoChat config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, hidden_act="relu2", final_logit_softcapping=cfg.final_logit_softcap, attention_bias=False,
                   pad_token_id=None)
