"""Hunyuan dense (`HunYuanDenseV1ForCausalLM`: Hunyuan-0.5B / 1.8B / 4B / 7B, Pretrain and Instruct): what its
config.json means here (`config_from_hf`, `config_to_hf`, `check_hf`).

The layer is Llama's with a per-head RMSNorm on queries and keys applied *after* RoPE (Qwen3 normalises before it;
`Attention.norm_after_rope`), named query_layernorm / key_layernorm on disk. The released checkpoints stretch the
RoPE base by a fixed NTK alpha (rope type "dynamic" with an `alpha`, which transformers computes once:
base * alpha ** (head_dim / (head_dim - 2))); that base is read here as the model's rope_theta, the same
frequencies, and written back as a plain base. Dynamic NTK scaling without an alpha and attention biases (which
would bias o_proj too) are refused.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM"}
QK_NORM_NAMES = ("query_layernorm", "key_layernorm")  # its q_norm / k_norm on disk
_DEFAULTS = dict(vocab_size=290943, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2)  # transformers' HunYuanDenseV1Config, where a config.json leaves a key out


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Hunyuan dense config.json (transformers' defaults where a key is absent)."""
    fields, _ = common_fields(d, model_type, _DEFAULTS, "Hunyuan")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: biases on the projections (o_proj's too) are not supported; "
                         "the released Hunyuan dense checkpoints have none.")
    rope, head_dim = fields["rope_scaling"], fields["head_dim"]
    if rope is not None and rope.get("rope_type", rope.get("type")) == "dynamic":
        if not rope.get("alpha"):
            raise ValueError(f"rope type 'dynamic' without an 'alpha' (dynamic NTK scaling, {rope}) is not supported; "
                             "Hunyuan's checkpoints give a fixed alpha.")
        fields.update(rope_theta=fields["rope_theta"] * float(rope["alpha"]) ** (head_dim / (head_dim - 2)),
                      rope_scaling=None)
    return cls(**fields, qk_norm=True, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' HunYuanDenseV1ForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Hunyuan dense", "q/k norm (after RoPE), no biases, and full-width RoPE in every layer without "
                   "windows", qk_norm=True, attention_bias=False, rotary_dim=None, sliding_window=None, rope_layers=None)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Hunyuan dense config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, attention_bias=False, mlp_bias=False, pad_token_id=None, eod_token_id=None)
