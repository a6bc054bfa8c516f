"""Cohere (`CohereForCausalLM`: Command R, Aya Expanse) and Cohere 2 (`Cohere2ForCausalLM`: Command R7B, Command A,
Command A Reasoning): what their config.json means here (`config_from_hf`, `config_to_hf`, `check_hf`).

A parallel block (`ModelConfig.parallel_block`): x + attn(norm(x)) + mlp(norm(x)), one LayerNorm without a bias
(`layer_norm`, `norm_bias` False; epsilon layer_norm_eps) feeding both; RoPE on interleaved pairs
(`rope_interleave`); the logits times logit_scale (here divided by its inverse, `logits_scaling`); head_dim is
hidden_size / num_attention_heads whatever the file says (transformers sets it so). Cohere 2's layer_types make three
of four layers slide over sliding_window positions; only those rotate, the full-attention layers have no position
embeddings at all (`rope_layers`). Names as Llama's, without post_attention_layernorm. Refused: Command R+'s q/k
LayerNorms (use_qk_norm), biases.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields, window_kinds, written_kinds

HF_CLASSES = {"cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM"}
_DEFAULTS = dict(vocab_size=256000, hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                 num_attention_heads=64, num_key_value_heads=None, max_position_embeddings=8192, layer_norm_eps=1e-5,
                 tie_word_embeddings=True, bos_token_id=5, eos_token_id=255001, logit_scale=0.0625,
                 sliding_window=4096)  # transformers' CohereConfig / Cohere2Config, where a key is absent


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Cohere or Cohere 2 config.json (transformers' defaults where a key is absent)."""
    if d.get("use_qk_norm"):
        raise ValueError("use_qk_norm: Cohere's per-head q/k LayerNorms (Command R+) are not supported here.")
    if d.get("attention_bias"):
        raise ValueError("attention_bias: Cohere's released checkpoints have no attention biases, and they are not "
                         "supported here.")
    eps = d.get("layer_norm_eps", _DEFAULTS["layer_norm_eps"])
    fields, get = common_fields({**d, "rms_norm_eps": eps, "head_dim": None}, model_type, _DEFAULTS,
                                HF_CLASSES[model_type].removesuffix("ForCausalLM"))
    scale = float(get("logit_scale"))
    if not scale > 0:
        raise ValueError(f"logit_scale={scale}: a positive logit scale is supported here.")
    own: dict[str, Any] = dict(rope_interleave=True, logits_scaling=None if scale == 1.0 else 1.0 / scale)
    if model_type == "cohere2":
        layers, window = fields["num_layers"], get("sliding_window")
        every = int(d.get("sliding_window_pattern", 4))
        types = window_kinds(d, layers, ("full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                         for i in range(layers)), "Cohere 2")
        rotating = tuple(int(t == "sliding_attention" and window is not None) for t in types)
        own.update(sliding_window=int(window) if window is not None and any(rotating) else None,
                   layer_types=types if window is not None and any(rotating) else None, rope_layers=rotating)
    return cls(**fields, **own, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' CohereForCausalLM / Cohere2ForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, HF_CLASSES[cfg.architecture], "a parallel block of attention (interleaved RoPE, no biases, no "
                   "q/k norm) and a SwiGLU MLP", attention_bias=False, qk_norm=False, rotary_dim=None,
                   rope_interleave=True, num_experts=0, rope_local_theta=None, head_dim=cfg.hidden_size // cfg.num_heads)
    if cfg.architecture == "cohere":
        require_fields(cfg, "Cohere", "full attention with RoPE in every layer", sliding_window=None, rope_layers=None)
        return
    want = tuple(int(cfg.layer_window(i) is not None) for i in range(cfg.num_layers))
    if tuple(cfg.rope_layers or (1,) * cfg.num_layers) != want:
        raise ValueError(f"HF Cohere 2 rotates exactly its sliding layers; set rope_layers={want}.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Cohere or Cohere 2 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    own = dict(layer_norm_eps=cfg.rms_norm_eps, logit_scale=1.0 / (cfg.logits_scaling or 1.0), attention_bias=False,
               use_qk_norm=False, pad_token_id=None)
    if cfg.architecture == "cohere2":
        own.update(sliding_window=cfg.sliding_window, layer_types=written_kinds(cfg))
    skip = ("rms_norm_eps", "head_dim", "logits_scaling")
    return hf_dict({k: v for k, v in common.items() if k not in skip}, **own)
