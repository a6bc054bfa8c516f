"""GLM-4 (`Glm4ForCausalLM`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1-9B / 32B-0414): what its config.json means here.

The layer: grouped-query attention with q/k/v biases (no o_proj bias), RoPE on interleaved pairs of the first
`partial_rotary_factor` (0.5) of each head (`ModelConfig.rope_interleave`, `rotary_dim`), and four RMSNorms as Gemma
places them (`ModelConfig.sandwich_norms`): before attention (input_layernorm), on its output
(post_self_attn_layernorm), before the MLP (post_attention_layernorm) and on its output (post_mlp_layernorm), each
scaling by w (not Gemma's 1 + w). The MLP's gate and up are one gate_up_proj on disk (split on loading, stacked again
on saving), as Phi-3's.
"""
from __future__ import annotations

from typing import Any

from areal_jax.models.hf_family import rename

PARTIAL_ROTARY = 0.5  # transformers' Glm4Config default
# the four norms' names, from the weight table's Gemma ones (in this order: the attention output's first)
_NAMES = ((".post_attention_layernorm.", ".post_self_attn_layernorm."),
          (".pre_feedforward_layernorm.", ".post_attention_layernorm."),
          (".post_feedforward_layernorm.", ".post_mlp_layernorm."))


def hf_name(name: str) -> str:
    """GLM-4's name of a tensor the weight table names as Gemma's (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def check_hf(cfg: Any) -> None:
    """Refuses a GLM-4 config that transformers' class would not load as it is; the error names the fields."""
    if cfg.architecture != "glm4":
        return
    if not cfg.rope_interleave or cfg.qk_norm or cfg.sliding_window is not None:
        raise ValueError("HF Glm4 rotates interleaved pairs and has no q/k norm and no sliding window; set "
                         "rope_interleave=True, qk_norm=False, sliding_window=None.")


def hf_dict(cfg: Any) -> dict:
    """GLM-4's own config.json keys (beside hf_config's common ones and `partial_rotary_keys`)."""
    return dict(attention_bias=cfg.attention_bias, pad_token_id=None)


def partial_rotary_keys(cfg: Any, d: dict) -> dict:
    """partial_rotary_factor (rope_dim / head_dim) where transformers reads it: at the top of config.json `d` and in
    its rope_parameters (Phi-3, GLM-4, GLM-4.5, MiniMax-M2)."""
    partial = cfg.rope_dim / cfg.head_dim
    return dict(partial_rotary_factor=partial, rope_parameters={**d["rope_parameters"], "partial_rotary_factor": partial})
