"""StarCoder2 (`Starcoder2ForCausalLM`: starcoder2-3b / 7b / 15b and their instruct models): what its config.json means
here (`config_from_hf`, `config_to_hf`, `check_hf`) and its tensors' names (`hf_name`).

Llama's pre-norm layer with LayerNorms (a scale and a bias; epsilon norm_epsilon), an ungated MLP c_proj(gelu(c_fc x))
(GELU with the tanh approximation: `ModelConfig.gated_mlp` False, `mlp_activation`), and with use_bias (the
released models) biases on q/k/v/o (`attention_bias`, `attention_out_bias`) and on c_fc / c_proj (`mlp_bias`); a
sliding window over sliding_window positions in every layer where set (starcoder2-15b: 4,096). Embeddings tied.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, rename, require_fields

HF_CLASSES = {"starcoder2": "Starcoder2ForCausalLM"}
_DEFAULTS = dict(vocab_size=49152, hidden_size=3072, intermediate_size=12288, num_hidden_layers=30,
                 num_attention_heads=24, num_key_value_heads=2, max_position_embeddings=4096, norm_epsilon=1e-5,
                 tie_word_embeddings=True, bos_token_id=50256, eos_token_id=50256, use_bias=True,
                 sliding_window=None)  # transformers' Starcoder2Config, where a key is absent
_NAMES = ((".mlp.up_proj.", ".mlp.c_fc."), (".mlp.down_proj.", ".mlp.c_proj."))


def hf_name(name: str, cfg: Any = None) -> str:
    """StarCoder2's name of a tensor the weight table names as Llama's (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a StarCoder2 config.json (transformers' defaults where a key is absent)."""
    eps = d.get("norm_epsilon", _DEFAULTS["norm_epsilon"])
    fields, get = common_fields({**d, "rms_norm_eps": eps}, model_type, _DEFAULTS, "StarCoder2", act="gelu_pytorch_tanh")
    bias, window = bool(get("use_bias")), get("sliding_window")
    return cls(**fields, attention_bias=bias, attention_out_bias=bias, mlp_bias=bias,
               sliding_window=None if window is None else int(window), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' Starcoder2ForCausalLM would not load as it is (and MLP biases elsewhere)."""
    if cfg.architecture not in HF_CLASSES:
        if cfg.mlp_bias and cfg.architecture not in ("gpt_neox", "phi", "jais2", "nemotron"):
            raise ValueError(f"mlp_bias (biases on the MLPs' projections) is StarCoder2's, GPT-NeoX's, Phi's, Jais 2's "
                             f"and Nemotron's; HF "
                             f"{cfg.architecture} has none here.")
        return
    require_fields(cfg, "StarCoder2", "one use_bias for q/k/v, o_proj and the MLP, no q/k norm, a window in every layer "
                   "or none, rotary embeddings over every dimension", attention_out_bias=cfg.attention_bias,
                   mlp_bias=cfg.attention_bias, qk_norm=False, layer_types=None, rotary_dim=None, rope_layers=None,
                   num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a StarCoder2 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict({k: v for k, v in common.items() if k != "rms_norm_eps"}, norm_epsilon=cfg.rms_norm_eps,
                   use_bias=cfg.attention_bias, sliding_window=cfg.sliding_window, hidden_act="gelu_pytorch_tanh",
                   pad_token_id=None)
