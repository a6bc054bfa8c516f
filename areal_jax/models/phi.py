"""Phi (`PhiForCausalLM`: phi-1, phi-1.5, phi-2): what its config.json means here (`config_from_hf`, `config_to_hf`,
`check_hf`) and its tensors' names (`hf_name`).

A parallel block (`ModelConfig.parallel_block`): x + attn(ln(x)) + mlp(ln(x)), one LayerNorm with a bias (epsilon
layer_norm_eps) feeding both; multi-head attention with biases on q/k/v and its output (`dense`); RoPE over the first
partial_rotary_factor of each head (phi-2: 0.4; transformers' default 0.5: `rotary_dim`); an ungated MLP with biases,
fc2(gelu_tanh(fc1 x)); a LayerNorm before the head (`final_layernorm`), and a bias on the logits (`lm_head_bias`).
Refused: q/k LayerNorms (qk_layernorm).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import (
    common_fields,
    hf_dict,
    partial_rope,
    rename,
    require_fields,
    rope_with_partial,
    rotary_dim_of,
)

HF_CLASSES = {"phi": "PhiForCausalLM"}
_DEFAULTS = dict(vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048, layer_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # transformers' PhiConfig, where absent
_NAMES = ((".self_attn.o_proj.", ".self_attn.dense."), (".mlp.up_proj.", ".mlp.fc1."), (".mlp.down_proj.", ".mlp.fc2."),
          ("model.norm.", "model.final_layernorm."))


def hf_name(name: str, cfg: Any = None) -> str:
    """Phi's name of a tensor the weight table names as Llama's (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Phi config.json (transformers' defaults where a key is absent)."""
    if d.get("qk_layernorm"):
        raise ValueError("qk_layernorm: Phi's q/k LayerNorms are not supported here (phi-1, phi-1.5 and phi-2 have "
                         "none).")
    d, factor = partial_rope(d, 0.5)
    eps = d.get("layer_norm_eps", _DEFAULTS["layer_norm_eps"])
    fields, _ = common_fields({**d, "rms_norm_eps": eps, "head_dim": None}, model_type, _DEFAULTS, "Phi", act="gelu_new")
    return cls(**fields, rotary_dim=rotary_dim_of(fields["head_dim"], factor), attention_bias=True,
               attention_out_bias=True, mlp_bias=True, lm_head_bias=True, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' PhiForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Phi", "biases on q/k/v, the attention's output, the MLP and the logits, no q/k norm and no "
                   "window, heads of hidden_size / num_attention_heads", attention_bias=True, attention_out_bias=True,
                   mlp_bias=True, lm_head_bias=True, qk_norm=False, sliding_window=None, rope_layers=None,
                   num_experts=0, tie_word_embeddings=False, head_dim=cfg.hidden_size // cfg.num_heads)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Phi config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    rope = rope_with_partial(cfg, common)
    skip = ("rms_norm_eps", "head_dim", "rope_parameters")
    return hf_dict({k: v for k, v in common.items() if k not in skip}, layer_norm_eps=cfg.rms_norm_eps,
                   rope_parameters=rope, hidden_act="gelu_new", qk_layernorm=False, pad_token_id=None)
