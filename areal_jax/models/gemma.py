"""Gemma (`GemmaForCausalLM`: gemma-2b / 7b, CodeGemma, gemma-1.1): what its config.json means here (`config_from_hf`,
`config_to_hf`, `check_hf`).

Gemma 2's layer without what Gemma 2 added (`ModelConfig.gemma`: RMSNorms scaling by 1 + w, a GELU-tanh gated MLP,
embeddings times sqrt(hidden_size); no norms after attention and the MLP, no soft caps, no windows): Llama's pre-norm
layer with those; heads of head_dim (256) scaled by head_dim ** -0.5. The released files' hidden_act "gelu" means the
tanh approximation (as transformers reads it). Names as Llama's. Refused: biases, bidirectional attention.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"gemma": "GemmaForCausalLM"}
_DEFAULTS = dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=16, head_dim=256, max_position_embeddings=8192,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)  # transformers' GemmaConfig


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Gemma config.json (transformers' defaults where a key is absent)."""
    if d.get("attention_bias") or d.get("use_bidirectional_attention"):
        raise ValueError("attention_bias / use_bidirectional_attention: Gemma here has no attention biases and "
                         "attends causally (as the released models).")
    act = d.get("hidden_act") or d.get("hidden_activation") or "gelu_pytorch_tanh"
    fields, _ = common_fields({**d, "hidden_act": "gelu_pytorch_tanh" if act == "gelu" else act}, model_type, _DEFAULTS,
                              "Gemma", act="gelu_pytorch_tanh")
    return cls(**fields, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' GemmaForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Gemma", "Llama's layer in Gemma's form (no biases, no q/k norm, no windows or soft caps, "
                   "every dimension of each head rotating)", attention_bias=False, qk_norm=False, sliding_window=None,
                   rotary_dim=None, rope_layers=None, query_pre_attn_scalar=None, num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Gemma config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, hidden_act="gelu_pytorch_tanh", attention_bias=False, pad_token_id=None)
