"""Ministral 3 (`Ministral3ForCausalLM`, and the text decoder of `Mistral3ForConditionalGeneration`: Ministral-3-3B /
8B / 14B, Base, Instruct and Reasoning): what its config.json means here (`config_from_hf`, `config_to_hf`,
`check_hf`, `text_config`).

The layer is Mistral's (a window over every layer when sliding_window is set). Its RoPE is YaRN, and after RoPE its
queries are multiplied by 1 + beta ln(1 + floor(position / original_max_position_embeddings)), beta the rope
parameters' llama_4_scaling_beta (`rope.query_position_scale`): 1 within the pretraining length (16,384 positions in
the released checkpoints), so the scale only acts on longer contexts. Both live in `ModelConfig.rope_scaling`, as
they do in transformers' rope_parameters. The image-and-text checkpoints (model_type "mistral3") hold the decoder
under text_config (Mistral-Small-3.x's is plain Mistral) and its weights under a prefix the loader strips; the
vision tower is never read.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields, text_decoder

HF_CLASSES = {"ministral3": "Ministral3ForCausalLM"}
WRAPPER = "mistral3"  # Mistral3ForConditionalGeneration's model_type: the text decoder under text_config
_ROPE = dict(rope_type="yarn", rope_theta=1_000_000.0, factor=16.0, original_max_position_embeddings=16384,
             max_position_embeddings=262144, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
             llama_4_scaling_beta=0.1)  # transformers' Ministral3Config's rope_parameters when a file gives none
_DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2)  # transformers' Ministral3Config, where a config.json leaves a key out


def text_config(d: dict) -> tuple[dict, str]:
    """(the text decoder's config.json keys, its model_type) of an image-and-text Mistral 3 config: its text_config
    (transformers' default type "mistral" where it names none), with the outer file's special tokens where the
    inner one has none."""
    text = d.get("text_config")
    model_type = (text.get("model_type") if isinstance(text, dict) else None) or "mistral"
    return text_decoder(d, "Mistral3ForConditionalGeneration", model_type, tied=True), model_type


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Ministral 3 config.json (transformers' defaults where a key is absent)."""
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: biases on the projections are not supported; Ministral 3 has "
                         "none.")
    if d.get("rope_parameters") is None and d.get("rope_scaling") is None:
        d = {**d, "rope_parameters": dict(_ROPE)}
    fields, get = common_fields(d, model_type, _DEFAULTS, "Ministral 3")
    rope = fields["rope_scaling"]
    if rope is None or rope.get("llama_4_scaling_beta") is None or rope.get("original_max_position_embeddings") is None:
        raise ValueError(f"Ministral 3's rope_parameters ({d.get('rope_parameters') or d.get('rope_scaling')}) need a "
                         "RoPE type other than 'default' with llama_4_scaling_beta and original_max_position_embeddings "
                         "(its checkpoints' YaRN; transformers' Ministral3Config writes them when the file gives none).")
    window = get("sliding_window")
    if window is not None and int(window) >= fields["max_position_embeddings"]:
        window = None  # as long as the context: it would change nothing
    return cls(**fields, sliding_window=None if window is None else int(window), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' Ministral3ForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Ministral 3", "Mistral's attention: no biases or q/k norm, full-width RoPE in every layer, "
                   "a window over every layer or none", attention_bias=False, qk_norm=False, rotary_dim=None,
                   layer_types=None, rope_layers=None)
    s = cfg.rope_scaling
    if s is None or s.get("llama_4_scaling_beta") is None:
        raise ValueError("HF Ministral 3 scales its queries by position: rope_scaling needs llama_4_scaling_beta "
                         "(and original_max_position_embeddings), e.g. its checkpoints' YaRN with beta 0.1.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Ministral 3 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, sliding_window=cfg.sliding_window, pad_token_id=None)
