"""Jais 2 (`Jais2ForCausalLM`: Jais-2-8B-Chat): what its config.json means here (`config_from_hf`, `config_to_hf`,
`check_hf`).

Llama's pre-norm layer with LayerNorms (a scale and a bias; epsilon layer_norm_eps), an ungated MLP
down_proj(relu(up_proj x) ** 2) (`ModelConfig.gated_mlp` False, `mlp_activation` "relu2"), and biases on q/k/v/o
(attention_bias: `attention_bias`, `attention_out_bias`) and on up_proj / down_proj (mlp_bias), both on by default and
in the released model. Names as Llama's.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"jais2": "Jais2ForCausalLM"}
_DEFAULTS = dict(vocab_size=150272, hidden_size=3328, intermediate_size=26624, num_hidden_layers=32,
                 num_attention_heads=26, max_position_embeddings=8192, layer_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=0, eos_token_id=150024, attention_bias=True, mlp_bias=True)  # transformers' Jais2Config


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Jais 2 config.json (transformers' defaults where a key is absent)."""
    eps = d.get("layer_norm_eps", _DEFAULTS["layer_norm_eps"])
    fields, get = common_fields({**d, "rms_norm_eps": eps}, model_type, _DEFAULTS, "Jais 2", act="relu2")
    bias = bool(get("attention_bias"))
    return cls(**fields, attention_bias=bias, attention_out_bias=bias, mlp_bias=bool(get("mlp_bias")), dtype=dtype,
               param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' Jais2ForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Jais 2", "one attention_bias for q/k/v and o_proj, no q/k norm, no window, rotary embeddings "
                   "over every dimension of every layer", attention_out_bias=cfg.attention_bias, qk_norm=False,
                   sliding_window=None, rotary_dim=None, rope_layers=None, num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Jais 2 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict({k: v for k, v in common.items() if k != "rms_norm_eps"}, layer_norm_eps=cfg.rms_norm_eps,
                   attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, hidden_act="relu2", pad_token_id=None)
