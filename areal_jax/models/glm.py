"""GLM (`GlmForCausalLM`: glm-4-9b, glm-4-9b-chat(-1m), in transformers' format): what its config.json means here
(`config_from_hf`, `config_to_hf`, `check_hf`).

GLM-4-0414's layer (`models/glm4.py`) without its two extra norms: Llama's pre-norm layer with grouped-query attention
that has q/k/v biases (attention_bias; none on o_proj), RoPE on interleaved pairs of the first partial_rotary_factor
(0.5) of each head (`rope_interleave`, `rotary_dim`), and an MLP whose gate and up are one gate_up_proj on disk (as
Phi-3's). Names as Llama's otherwise.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.glm4 import PARTIAL_ROTARY, partial_rotary_keys
from areal_jax.models.hf_family import common_fields, hf_dict, partial_rope, require_fields, rotary_dim_of
from areal_jax.models.tensor_layout import Layout

HF_CLASSES = {"glm": "GlmForCausalLM"}
LAYOUTS = {"glm": Layout(gate_up="fused")}
_DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                 num_attention_heads=32, num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                 rms_norm_eps=1.5625e-07, tie_word_embeddings=False, attention_bias=True)  # transformers' GlmConfig


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a GLM config.json (transformers' defaults where a key is absent)."""
    d, factor = partial_rope(d, PARTIAL_ROTARY)
    fields, get = common_fields(d, model_type, _DEFAULTS, "GLM")
    return cls(**fields, attention_bias=bool(get("attention_bias")), rope_interleave=True,
               rotary_dim=rotary_dim_of(fields["head_dim"], factor), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' GlmForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "GLM", "Llama's layer rotating interleaved pairs (no q/k norm, no window, no o_proj bias)",
                   rope_interleave=True, qk_norm=False, sliding_window=None, rope_layers=None, attention_out_bias=False,
                   num_experts=0)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a GLM config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, **partial_rotary_keys(cfg, common), attention_bias=cfg.attention_bias, pad_token_id=None)
