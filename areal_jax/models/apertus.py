"""Apertus (`ApertusForCausalLM`: Apertus-8B / 70B and their instruct models): what its config.json means here
(`config_from_hf`, `config_to_hf`, `check_hf`) and its tensors' names (`hf_name`).

Llama's pre-norm layer with Qwen3's q/k norms (RMSNorm over each head before RoPE), Llama 3's RoPE scaling (base 1.2e7
by default) and an ungated MLP down(xielu(up x)) (`layers.xielu`: its per-layer scalars alpha_p, alpha_n trained,
beta and eps, transformers' buffers, held fixed). Its norms are named attention_layernorm and feedforward_layernorm,
the activation's scalars mlp.act_fn.*. Refused: biases, other activations.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, rename, require_fields

HF_CLASSES = {"apertus": "ApertusForCausalLM"}
_DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=65536, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # transformers' ApertusConfig
_ROPE = {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0}  # its default rope_parameters
_NAMES = ((".input_layernorm.", ".attention_layernorm."), (".post_attention_layernorm.", ".feedforward_layernorm."))


def hf_name(name: str, cfg: Any = None) -> str:
    """Apertus' name of a tensor the weight table names as Llama's (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an Apertus config.json (transformers' defaults where a key is absent)."""
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: Apertus has no biases (as the released models).")
    d = {**d, "rope_parameters": d.get("rope_parameters") or d.get("rope_scaling") or _ROPE}
    fields, _ = common_fields(d, model_type, _DEFAULTS, "Apertus", act="xielu")
    return cls(**fields, qk_norm=True, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' ApertusForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Apertus", "Llama's layer with q/k norms per head (no biases, no window, every dimension of "
                   "each head rotating)", qk_norm=True, attention_bias=False, sliding_window=None, rotary_dim=None,
                   rope_layers=None, num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an Apertus config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, hidden_act="xielu", attention_bias=False, mlp_bias=False, pad_token_id=None)
