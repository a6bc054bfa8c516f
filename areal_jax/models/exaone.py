"""EXAONE 4.0 (`Exaone4ForCausalLM`: EXAONE-4.0-1.2B, -32B): what its config.json means here (`config_from_hf`,
`config_to_hf`, `check_hf`).

The layer is OLMo 2's (`ModelConfig.olmo`: a norm on the attention's and on the MLP's output, none before them)
with Qwen3's q/k norm (per head) and no biases. With a sliding window, the layers `layer_types` names
"sliding_attention" (by default all but every `sliding_window_pattern`-th) attend to their window with RoPE, and the
others attend to everything without it (`ModelConfig.rope_layers`); without one every layer is global and rotates.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields

HF_CLASSES = {"exaone4": "Exaone4ForCausalLM"}
_DEFAULTS = dict(vocab_size=102400, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, sliding_window=4096, sliding_window_pattern=4, bos_token_id=0,
                 eos_token_id=2)  # transformers' Exaone4Config, where a config.json leaves a key out


def _layer_types(get: Any, layers: int) -> list[str]:
    """Each layer's type as transformers' Exaone4Config sets it: `layer_types`, else with a window all but every
    sliding_window_pattern-th layer slide (a string pattern such as "LLLG": 'L' slides, repeated), else none."""
    types = get("layer_types")
    if types is not None:
        if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ValueError(f"layer_types must list 'sliding_attention' or 'full_attention' for each of the "
                             f"{layers} layers; got {types}.")
        return list(types)
    if get("sliding_window") is None:
        return ["full_attention"] * layers
    pattern = get("sliding_window_pattern")
    if isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise ValueError(f"sliding_window_pattern={pattern!r}: write it with 'L' (sliding) and 'G' (global).")
        return ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(layers)]
    if not pattern or int(pattern) < 1:
        raise ValueError(f"sliding_window_pattern={pattern!r} must be a positive integer or an 'L'/'G' string.")
    return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an EXAONE 4.0 config.json (transformers' defaults where a key is absent)."""
    fields, get = common_fields(d, model_type, _DEFAULTS, "EXAONE 4.0")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("EXAONE 4.0 has no biases; attention_bias / mlp_bias must be false.")
    types = _layer_types(get, fields["num_layers"])
    window = get("sliding_window")
    sliding = window is not None and "sliding_attention" in types
    if "sliding_attention" in types and window is None:
        raise ValueError("layer_types names sliding layers but sliding_window is null; give the window's length.")
    return cls(**fields, qk_norm=True, sliding_window=int(window) if sliding else None,
               layer_types=tuple(types) if sliding else None,
               rope_layers=tuple(int(t == "sliding_attention") for t in types) if sliding else None,
               dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' Exaone4ForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    sliding = [cfg.layer_window(i) is not None for i in range(cfg.num_layers)]
    require_fields(cfg, "EXAONE 4.0", "q/k norm, no q/k/v bias and one full-width RoPE", qk_norm=True,
                   attention_bias=False, rotary_dim=None, rope_local_theta=None)
    rotates = [cfg.layer_rope(i) != "none" for i in range(cfg.num_layers)]
    if rotates != (sliding if any(sliding) else [True] * cfg.num_layers):
        raise ValueError("HF EXAONE 4.0 rotates exactly its sliding layers when some slide (every layer when none "
                         f"does); rope_layers={cfg.rope_layers} does not match the layers' windows {sliding}.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an EXAONE 4.0 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    types = ["sliding_attention" if cfg.layer_window(i) is not None else "full_attention" for i in range(cfg.num_layers)]
    return hf_dict(common, sliding_window=cfg.sliding_window if "sliding_attention" in types else None,
                   sliding_window_pattern=None, layer_types=types, attention_bias=False, pad_token_id=None)
