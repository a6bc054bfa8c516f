"""GPT-NeoX (`GPTNeoXForCausalLM`: Pythia 14M ... 12B, GPT-NeoX-20B): what its config.json means here (`config_from_hf`,
`config_to_hf`, `check_hf`) and its tensors' names (`hf_name`).

A parallel block with two LayerNorms (scales and biases): x + attn(ln1(x)) + mlp(ln2(x)) (`ModelConfig.parallel_block`,
`parallel_mlp_norm`; use_parallel_residual, as every released model); attention with biases on q/k/v and the output
(attention_bias), q, k and v in one query_key_value whose rows hold each head's q, k and v side by side; RoPE over
the first partial_rotary_factor (rotary_pct: 0.25) of each head (`rotary_dim`); an ungated MLP with biases,
dense_4h_to_h(gelu(dense_h_to_4h x)) with the exact GELU. Names: gpt_neox.embed_in, gpt_neox.layers.{i}.{input_layernorm,
post_attention_layernorm, attention.{query_key_value, dense}, mlp.{dense_h_to_4h, dense_4h_to_h}},
gpt_neox.final_layer_norm, embed_out (transformers' lm_head; a checkpoint holding lm_head.weight loads too).
Refused: use_parallel_residual false, a hidden_act other than GELU.
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
from areal_jax.models.tensor_layout import Layout

HF_CLASSES = {"gpt_neox": "GPTNeoXForCausalLM"}
LAYOUTS = {"gpt_neox": Layout(qkv="per_head")}  # one query_key_value, head by head
_DEFAULTS = dict(vocab_size=50432, hidden_size=6144, intermediate_size=24576, num_hidden_layers=44,
                 num_attention_heads=64, max_position_embeddings=2048, layer_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=0, eos_token_id=2, attention_bias=True)  # transformers' GPTNeoXConfig, where a key is absent
_NAMES = (("model.embed_tokens.", "gpt_neox.embed_in."), ("model.norm.", "gpt_neox.final_layer_norm."),
          ("lm_head.", "embed_out."), ("model.layers.", "gpt_neox.layers."), (".self_attn.o_proj.", ".attention.dense."),
          (".self_attn.", ".attention."), (".mlp.up_proj.", ".mlp.dense_h_to_4h."),
          (".mlp.down_proj.", ".mlp.dense_4h_to_h."))


def hf_name(name: str, cfg: Any = None) -> str:
    """GPT-NeoX's name of a tensor the weight table names as Llama's (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a GPT-NeoX config.json (transformers' defaults where a key is absent; rotary_pct and
    rotary_emb_base, the older keys, as transformers reads them)."""
    if not d.get("use_parallel_residual", True):
        raise ValueError("use_parallel_residual=false: GPT-NeoX's sequential residual is not supported here (every "
                         "released model uses the parallel one).")
    d, factor = partial_rope({**d, "rope_theta": d.get("rotary_emb_base", d.get("rope_theta", 10000.0))}, 0.25,
                             key="rotary_pct")
    eps = d.get("layer_norm_eps", _DEFAULTS["layer_norm_eps"])
    fields, get = common_fields({**d, "rms_norm_eps": eps, "num_key_value_heads": None, "head_dim": None}, model_type,
                                _DEFAULTS, "GPT-NeoX", act="gelu")
    bias = bool(get("attention_bias"))
    return cls(**fields, rotary_dim=rotary_dim_of(fields["head_dim"], factor), attention_bias=bias,
               attention_out_bias=bias, mlp_bias=True, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' GPTNeoXForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "GPT-NeoX", "multi-head attention (one key/value head per query head, biases on q/k/v and the "
                   "output alike, no q/k norm, no window) and MLPs with biases", num_kv_heads=cfg.num_heads,
                   head_dim=cfg.hidden_size // cfg.num_heads, attention_out_bias=cfg.attention_bias, mlp_bias=True,
                   qk_norm=False, sliding_window=None, rope_layers=None, num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a GPT-NeoX config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    rope = rope_with_partial(cfg, common)
    skip = ("rms_norm_eps", "head_dim", "num_key_value_heads", "rope_parameters")
    return hf_dict({k: v for k, v in common.items() if k not in skip}, layer_norm_eps=cfg.rms_norm_eps,
                   rope_parameters=rope, attention_bias=cfg.attention_bias, use_parallel_residual=True,
                   hidden_act="gelu", pad_token_id=None)
