"""EXAONE 4.0 (`Exaone4ForCausalLM`: EXAONE-4.0-1.2B, -32B) and EXAONE MoE (`ExaoneMoeForCausalLM`:
K-EXAONE-236B-A23B): what their config.json means here (`config_from_hf`, `config_to_hf`, `check_hf`).

EXAONE 4.0's layer is OLMo 2's (`ModelConfig.olmo`: a norm on the attention's and on the MLP's output, none before
them) with Qwen3's q/k norm (per head) and no biases. With a sliding window, the layers `layer_types` names
"sliding_attention" (by default all but every `sliding_window_pattern`-th) attend to their window with RoPE, and the
others attend to everything without it (`ModelConfig.rope_layers`); without one every layer is global and rotates.

EXAONE MoE has the same attention (q/k norm per head, the windows, the global layers without RoPE) in Llama's layer
(a norm before the attention and before the MLP), and DeepSeek-V3's mixture of experts: the layers `mlp_layer_types`
calls "sparse" (by default all after the first `first_k_dense_replace`) route each token to `num_experts_per_tok` of
`num_experts` experts of moe_intermediate_size by sigmoid scores, picked with a bias (`e_score_correction_bias`,
beside the gate on disk: mlp.e_score_correction_bias) within the best `topk_group` of `n_group` groups, renormalised
(`norm_topk_prob`) and times `routed_scaling_factor`, plus `num_shared_experts` ungated shared experts (one MLP of
num_shared_experts x moe_intermediate_size); "dense" layers have an MLP of intermediate_size. The
multi-token-prediction weights (mtp.*) are not read.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.deepseek import router_fields
from areal_jax.models.hf_family import common_fields, hf_dict, require_fields
from areal_jax.models.tensor_layout import Layout

HF_CLASSES = {"exaone4": "Exaone4ForCausalLM", "exaone_moe": "ExaoneMoeForCausalLM"}
LAYOUTS = {"exaone_moe": Layout(score_bias="beside")}  # its picking bias beside the router
_DEFAULTS = dict(vocab_size=102400, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, sliding_window=4096, sliding_window_pattern=4, bos_token_id=0,
                 eos_token_id=2)  # transformers' Exaone4Config, where a config.json leaves a key out
_MOE_DEFAULTS = dict(_DEFAULTS, bos_token_id=1, eos_token_id=53, first_k_dense_replace=1, moe_intermediate_size=1024,
                     num_experts=64, num_experts_per_tok=8, num_shared_experts=1, norm_topk_prob=True,
                     routed_scaling_factor=2.5, n_group=1, topk_group=1)  # transformers' ExaoneMoeConfig


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


def _moe_fields(get: Any, layers: int) -> dict:
    """EXAONE MoE's ModelConfig fields of its experts and router (`mlp_layer_types`, else the first
    first_k_dense_replace layers dense)."""
    types = get("mlp_layer_types") or ["dense" if i < int(get("first_k_dense_replace") or 0) else "sparse"
                                       for i in range(layers)]
    if len(types) != layers or set(types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} layers; got "
                         f"{types!r}.")
    if get("scoring_func") not in (None, "sigmoid") or get("topk_method") not in (None, "noaux_tc"):
        raise ValueError("EXAONE MoE routes by sigmoid scores with a picking bias (transformers' ExaoneMoeTopkRouter, "
                         f"whatever scoring_func / topk_method say); this config names {get('scoring_func')!r} / "
                         f"{get('topk_method')!r}: it is another model.")
    flags = tuple(int(t == "sparse") for t in types)
    return dict(router_fields(get, "num_experts", "num_shared_experts", sigmoid=True, grouped=True),
                moe_layers=None if all(flags) else flags)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an EXAONE 4.0 or EXAONE MoE config.json (transformers' defaults where a key is absent)."""
    moe = model_type == "exaone_moe"
    family = "EXAONE MoE" if moe else "EXAONE 4.0"
    fields, get = common_fields(d, model_type, _MOE_DEFAULTS if moe else _DEFAULTS, family)
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError(f"{family} has no biases; attention_bias / mlp_bias must be false.")
    window = get("sliding_window")
    if moe and window is None:
        raise ValueError("sliding_window=null: transformers' ExaoneMoeConfig takes only a length (its global layers "
                         "skip RoPE whatever the window, so no EXAONE MoE rotates every layer); give the window's "
                         "length, and list every layer in layer_types as 'full_attention' for no sliding layer.")
    types = _layer_types(get, fields["num_layers"])
    sliding = window is not None and "sliding_attention" in types
    if "sliding_attention" in types and window is None:
        raise ValueError("layer_types names sliding layers but sliding_window is null; give the window's length.")
    return cls(**fields, qk_norm=True, sliding_window=int(window) if sliding else None,
               layer_types=tuple(types) if sliding else None,
               rope_layers=tuple(int(t == "sliding_attention") for t in types) if sliding or moe else None,
               **(_moe_fields(get, fields["num_layers"]) if moe else {}), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' Exaone4ForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    family = "EXAONE MoE" if cfg.architecture == "exaone_moe" else "EXAONE 4.0"
    sliding = [cfg.layer_window(i) is not None for i in range(cfg.num_layers)]
    require_fields(cfg, family, "q/k norm, no q/k/v bias and one full-width RoPE", qk_norm=True,
                   attention_bias=False, rotary_dim=None, rope_local_theta=None)
    rotates = [cfg.layer_rope(i) != "none" for i in range(cfg.num_layers)]
    if cfg.architecture == "exaone_moe" and rotates != sliding:
        raise ValueError(f"HF {family} rotates exactly its sliding layers (none when no layer slides: its config always "
                         f"has a window); rope_layers={cfg.rope_layers} does not match the layers' windows {sliding}.")
    if cfg.architecture == "exaone4" and rotates != (sliding if any(sliding) else [True] * cfg.num_layers):
        raise ValueError(f"HF {family} rotates exactly its sliding layers when some slide (every layer when none "
                         f"does); rope_layers={cfg.rope_layers} does not match the layers' windows {sliding}.")
    if cfg.architecture == "exaone_moe":
        require_fields(cfg, family, "DeepSeek-V3's router (sigmoid scores, a picking bias) and ungated shared "
                       "experts", router_scoring="sigmoid", router_score_bias=True, shared_expert_gated=False)
        if cfg.shared_expert_size is not None and cfg.shared_expert_size % cfg.expert_size:
            raise ValueError(f"HF {family}'s shared experts are num_shared_experts x moe_intermediate_size wide; "
                             f"shared_expert_size={cfg.shared_expert_size} is not a multiple of {cfg.expert_size}.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an EXAONE 4.0 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    types = ["sliding_attention" if cfg.layer_window(i) is not None else "full_attention" for i in range(cfg.num_layers)]
    own = {}
    if cfg.architecture == "exaone_moe":
        n_group, topk_group = cfg.router_groups or (1, 1)
        own = dict(mlp_layer_types=["sparse" if cfg.layer_is_moe(i) else "dense" for i in range(cfg.num_layers)],
                   num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.expert_size,
                   num_shared_experts=(cfg.shared_expert_size or 0) // cfg.expert_size, n_group=n_group,
                   topk_group=topk_group, norm_topk_prob=cfg.norm_topk_prob,
                   routed_scaling_factor=cfg.routed_scaling_factor)
    window = cfg.sliding_window if "sliding_attention" in types else None
    if cfg.architecture == "exaone_moe" and window is None:
        window = _MOE_DEFAULTS["sliding_window"]  # (a length it must have; no layer slides)
    return hf_dict(common, sliding_window=window,
                   sliding_window_pattern=None, layer_types=types, attention_bias=False, pad_token_id=None, **own)
