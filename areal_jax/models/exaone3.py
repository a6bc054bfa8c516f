"""EXAONE 3 / 3.5 and EXAONE Deep (model type `exaone`: EXAONE-3.5-2.4B / 7.8B / 32B, EXAONE-Deep-2.4B / 7.8B / 32B):
what their config.json means here (`config_from_hf`, `config_to_hf`, `check_hf`).

Llama's layer under other names (transformers loads these models as LlamaForCausalLM): the config's num_layers,
layer_norm_epsilon and activation_function are num_hidden_layers, rms_norm_eps and hidden_act; the released tensors'
transformer.wte, transformer.h.{i}.{ln_1, attn.attention.{q,k,v,out}_proj, ln_2, mlp.{c_fc_0, c_fc_1, c_proj}} and
transformer.ln_f answer to Llama's names on loading (`disk_names.CONVERSIONS`, as transformers' conversion renames
them); a checkpoint written here has Llama's names (model.*), which transformers loads as they are. Refused: biases.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"exaone": "LlamaForCausalLM"}  # (transformers' class for model type exaone)
_DEFAULTS = dict(vocab_size=102400, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=361)  # transformers' ExaoneConfig
_KEYS = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"}


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an EXAONE 3 / 3.5 config.json (its own key names or Llama's; transformers' defaults where a key
    is absent, RoPE base 5e5)."""
    d = {**{new: d[old] for old, new in _KEYS.items() if old in d}, **d}
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: EXAONE 3 has no biases (as the released models).")
    if "rope_theta" not in d and "rope_theta" not in (d.get("rope_parameters") or d.get("rope_scaling") or {}):
        d = {**d, "rope_theta": 500000.0}  # ExaoneConfig's default base
    fields, _ = common_fields(d, model_type, _DEFAULTS, "EXAONE 3")
    return cls(**fields, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' class for EXAONE 3 (Llama's) would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "EXAONE 3", "Llama's layer (no biases, no q/k norm, no window, rotary embeddings over every "
                   "dimension of every head)", attention_bias=False, qk_norm=False, sliding_window=None,
                   rotary_dim=None, rope_layers=None, num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an EXAONE 3 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, attention_bias=False, mlp_bias=False, pad_token_id=None)
