"""Youtu-LLM (`YoutuForCausalLM`: tencent/Youtu-LLM-2B): what its config.json means here (`config_from_hf`,
`config_to_hf`, `check_hf`).

DeepSeek-V3's multi-head latent attention (`models.mla`: queries through a rank q_lora_rank, keys and values through
the latent kv_lora_rank, qk_nope_head_dim + qk_rope_head_dim wide query / key heads, v_head_dim wide values, the rotary
pairs interleaved with rope_interleave) in Llama's layer with a dense SwiGLU MLP in every layer (no experts), embeddings
tied by default. Tensors named as DeepSeek-V3's dense layers.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.config_checks import MLA
from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"youtu": "YoutuForCausalLM"}
_DEFAULTS = dict(vocab_size=128256, hidden_size=2048, intermediate_size=6144, num_hidden_layers=32,
                 num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=131072, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001, kv_lora_rank=512,
                 q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128)  # transformers' YoutuConfig


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Youtu-LLM config.json (transformers' defaults where a key is absent)."""
    if d.get("attention_bias"):
        raise ValueError("Youtu-LLM has no attention biases; this config.json sets attention_bias.")
    fields, get = common_fields({**d, "head_dim": None}, model_type, _DEFAULTS, "Youtu-LLM")
    rank = get("q_lora_rank")
    mla = MLA(None if rank is None else int(rank), int(get("kv_lora_rank")), int(get("qk_nope_head_dim")),
              int(get("qk_rope_head_dim")), int(get("v_head_dim")), bool(d.get("rope_interleave", True)))
    fields.update(num_kv_heads=fields["num_heads"], head_dim=mla.nope + mla.rope)
    return cls(**fields, mla=mla, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' YoutuForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Youtu-LLM", "latent attention beside dense MLPs (no biases, no windows, no experts)",
                   attention_bias=False, sliding_window=None, num_experts=0, rope_layers=None)
    if cfg.mla is None:
        raise ValueError("HF Youtu-LLM has multi-head latent attention; set mla=MLA(...).")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Youtu-LLM config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    m = cfg.mla
    d = {k: v for k, v in common.items() if k not in ("head_dim", "layer_types", "sliding_window")}
    return hf_dict(d, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.nope,
                   qk_rope_head_dim=m.rope, v_head_dim=m.v, rope_interleave=m.interleave, attention_bias=False,
                   pad_token_id=None)
