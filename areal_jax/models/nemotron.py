"""Nemotron (`NemotronForCausalLM`: Nemotron-Mini-4B-Instruct, Minitron-4B / 8B-Base, Nemotron-3-8B): what its
config.json means here (`config_from_hf`, `config_to_hf`, `check_hf`).

Llama's pre-norm layer with LayerNorm1P norms: mean removed, divided by the standard deviation, times 1 + w (w stored
as the offset from one, `ModelConfig.norm_offset`) plus a bias (epsilon norm_eps); an ungated MLP
down_proj(relu(up_proj x) ** 2) (`gated_mlp` False, `mlp_activation` "relu2"); RoPE over the first
partial_rotary_factor (0.5) of each head (`rotary_dim`); attention_bias (q/k/v and o_proj together) and mlp_bias
(up_proj, down_proj) as the file says, off by default and in the released models. Names as Llama's.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import (
    common_fields,
    hf_dict,
    partial_rope,
    require_fields,
    rope_with_partial,
    rotary_dim_of,
)

HF_CLASSES = {"nemotron": "NemotronForCausalLM"}
_DEFAULTS = dict(vocab_size=256000, hidden_size=6144, intermediate_size=24576, num_hidden_layers=32,
                 num_attention_heads=48, max_position_embeddings=4096, norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=2, eos_token_id=3, attention_bias=False, mlp_bias=False)  # transformers' NemotronConfig


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Nemotron config.json (transformers' defaults where a key is absent)."""
    d, factor = partial_rope(d, 0.5)
    eps = d.get("norm_eps", _DEFAULTS["norm_eps"])
    fields, get = common_fields({**d, "rms_norm_eps": eps}, model_type, _DEFAULTS, "Nemotron", act="relu2")
    bias = bool(get("attention_bias"))
    return cls(**fields, rotary_dim=rotary_dim_of(fields["head_dim"], factor), attention_bias=bias,
               attention_out_bias=bias, mlp_bias=bool(get("mlp_bias")), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' NemotronForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Nemotron", "one attention_bias for q/k/v and o_proj, no q/k norm, no window, rotary "
                   "embeddings in every layer", attention_out_bias=cfg.attention_bias, qk_norm=False,
                   sliding_window=None, rope_layers=None, num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Nemotron config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    rope = rope_with_partial(cfg, common)
    return hf_dict({k: v for k, v in common.items() if k not in ("rms_norm_eps", "rope_parameters")},
                   norm_eps=cfg.rms_norm_eps, rope_parameters=rope, attention_bias=cfg.attention_bias,
                   mlp_bias=cfg.mlp_bias, hidden_act="relu2", pad_token_id=None)
