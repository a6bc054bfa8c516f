"""StableLM (`StableLmForCausalLM`: stablelm-2-1_6b, stablelm-zephyr-3b, stablelm-3b-4e1t): what its config.json means
here (`config_from_hf`, `config_to_hf`, `check_hf`).

Llama's pre-norm layer with LayerNorms (a scale and a bias; epsilon layer_norm_eps), RoPE over the first
partial_rotary_factor (0.25) of each head (`rotary_dim`), q/k/v biases where use_qkv_bias says (stablelm-2-1_6b: yes)
and a SwiGLU MLP. Names as Llama's. Refused: StableLM 2 12B's per-head q/k LayerNorms (qk_layernorm) and parallel
residual (use_parallel_residual).
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

HF_CLASSES = {"stablelm": "StableLmForCausalLM"}
_DEFAULTS = dict(vocab_size=50304, hidden_size=2560, intermediate_size=6912, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, layer_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)  # transformers' StableLmConfig


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a StableLM config.json (transformers' defaults where a key is absent)."""
    if d.get("qk_layernorm") or d.get("use_parallel_residual"):
        raise ValueError("qk_layernorm / use_parallel_residual: StableLM 2 12B's per-head q/k LayerNorms and parallel "
                         "residual are not supported here (stablelm-2-1_6b and the 3B models have neither).")
    d, factor = partial_rope(d, 0.25)
    eps = d.get("layer_norm_eps", _DEFAULTS["layer_norm_eps"])
    fields, _ = common_fields({**d, "rms_norm_eps": eps, "head_dim": None}, model_type, _DEFAULTS, "StableLM")
    return cls(**fields, rotary_dim=rotary_dim_of(fields["head_dim"], factor),
               attention_bias=bool(d.get("use_qkv_bias", False)), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' StableLmForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "StableLM", "Llama's layer with LayerNorms (no q/k norm, no window, no o_proj bias, heads of "
                   "hidden_size / num_attention_heads)", qk_norm=False, sliding_window=None, rope_layers=None,
                   attention_out_bias=False, num_experts=0, head_dim=cfg.hidden_size // cfg.num_heads)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a StableLM config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    rope = rope_with_partial(cfg, common)
    skip = ("rms_norm_eps", "head_dim", "rope_parameters")
    return hf_dict({k: v for k, v in common.items() if k not in skip}, layer_norm_eps=cfg.rms_norm_eps,
                   rope_parameters=rope, use_qkv_bias=cfg.attention_bias, qk_layernorm=False,
                   use_parallel_residual=False, pad_token_id=None)
