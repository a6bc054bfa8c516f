"""FlexOlmo (`FlexOlmoForCausalLM`: FlexOlmo-7x7B-1T and its variants): what its config.json means here
(`config_from_hf`, `config_to_hf`, `check_hf`).

OLMo 2's layer (norms after attention and after the feed-forward only, q/k RMSNorm over all heads together) with
OLMoE's experts in place of the MLP: num_experts of intermediate_size in every layer, a softmax router's top
num_experts_per_tok, renormalised where norm_topk_prob says; on disk as OLMoE's (mlp.gate, mlp.experts.{j}.gate_proj /
up_proj / down_proj).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"flex_olmo": "FlexOlmoForCausalLM"}
_DEFAULTS = dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 bos_token_id=None, eos_token_id=100257, num_experts=7, num_experts_per_tok=5,
                 norm_topk_prob=False)  # transformers' FlexOlmoConfig, where a config.json leaves a key out


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a FlexOlmo config.json (transformers' defaults where a key is absent)."""
    fields, get = common_fields(d, model_type, _DEFAULTS, "FlexOlmo")
    if "rope_theta" not in d and "rope_theta" not in (d.get("rope_parameters") or {}):
        fields["rope_theta"] = 500000.0  # FlexOlmoConfig's default base
    if d.get("attention_bias"):
        raise ValueError("attention_bias: FlexOlmo's released checkpoints have no attention biases, and biases beside "
                         "OLMo's q/k norm are not supported here.")
    experts = d.get("num_experts", d.get("num_local_experts", _DEFAULTS["num_experts"]))
    return cls(**fields, qk_norm=True, num_experts=int(experts), num_experts_per_tok=int(get("num_experts_per_tok")),
               norm_topk_prob=bool(get("norm_topk_prob")), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' FlexOlmoForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "FlexOlmo", "OLMo 2's attention (q/k norm over all heads, no biases, full-width RoPE in every "
                   "layer without windows) and experts of intermediate_size in every layer, without a shared one",
                   attention_bias=False, qk_norm=True, rotary_dim=None, sliding_window=None, rope_layers=None,
                   moe_layers=None, moe_intermediate_size=None, shared_expert_size=None)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a FlexOlmo config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, hidden_act="silu", attention_bias=False, num_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                   output_router_logits=False, pad_token_id=None)
