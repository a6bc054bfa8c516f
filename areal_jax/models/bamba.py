"""Bamba (`BambaForCausalLM`: Bamba-9B): what its config.json means here (`config_from_hf`, `config_to_hf`,
`check_hf`) and its tensors' names (`hf_name`).

Llama's pre-norm layer whose token mixer is, in most layers, a Mamba-2 mixer (`models.mamba2`: the mamba_* keys, as
Granite 4.0-H's) and attention in those `attn_layer_indices` names; the attention rotates the first half of each head
(partial_rotary_factor 0.5, which transformers sets whatever the file says). Its MLP is feed_forward.{gate,up,down}_proj,
the norm before it pre_ff_layernorm, the last norm final_layernorm.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, rename, require_fields
from areal_jax.models.mamba2 import hf_keys, shapes_from_hf

HF_CLASSES = {"bamba": "BambaForCausalLM"}
_DEFAULTS = dict(vocab_size=128000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=262144, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # transformers' BambaConfig
_NAMES = ((".mlp.", ".feed_forward."), (".post_attention_layernorm.", ".pre_ff_layernorm."),
          (".linear_attn.", ".mamba."), ("model.norm.", "model.final_layernorm."))


def hf_name(name: str, cfg: Any = None) -> str:
    """Bamba's name of a tensor the weight table names as Llama does (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Bamba config.json (transformers' defaults where a key is absent)."""
    rope = {k: v for k, v in (d.get("rope_parameters") or {}).items() if k != "partial_rotary_factor"}
    fields, get = common_fields({**d, "rope_parameters": rope or None, "partial_rotary_factor": None}, model_type,
                                _DEFAULTS, "Bamba")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: Bamba's released checkpoints have no biases there, and they are "
                         "not supported here.")
    layers, attention = fields["num_layers"], set(d.get("attn_layer_indices") or ())
    types = tuple("full_attention" if i in attention else "linear_attention" for i in range(layers))
    mamba = shapes_from_hf(d, fields["hidden_size"]) if "linear_attention" in types else None
    return cls(**fields, rotary_dim=fields["head_dim"] // 2, layer_types=None if mamba is None else types, mamba=mamba,
               dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' BambaForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Bamba", "Llama's attention rotating half of each head (no biases, no q/k norm, no windows) and "
                   "dense MLPs", attention_bias=False, qk_norm=False, rotary_dim=cfg.head_dim // 2, sliding_window=None,
                   rope_layers=None, linear=None, num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Bamba config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    attention = [i for i in range(cfg.num_layers) if not cfg.layer_is_linear(i)]
    mamba = {} if cfg.mamba is None else hf_keys(cfg)
    return hf_dict(common, **mamba, attn_layer_indices=attention, attention_bias=False, mlp_bias=False,
                   pad_token_id=None)
