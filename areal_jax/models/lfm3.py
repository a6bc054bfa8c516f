"""LFM3 (`Lfm3ForCausalLM`: LFM3-1.7B): what its config.json means here (`config_from_hf`, `config_to_hf`,
`check_hf`); its tensors' names are `lfm2.hf_name`'s.

LFM2's hybrid (gated short convolutions, `models.short_conv`, of conv_L_cache taps between attention layers; SwiGLU
MLPs of intermediate_size; the final norm named embedding_norm) with: a norm after the mixer and after the MLP too
(use_sandwich_norm: Gemma's four norms a layer); sliding-window layers besides the global ones, each kind with its own
RoPE (rope_parameters per layer type: by default the sliding layers' base 10,000, the global layers' "proportional"
RoPE of base 10^6 turning the first half of each head's pairs only); each attention head's output times
sigmoid(x . g_proj) of the layer's input (use_attention_gate: `ModelConfig.head_gate`); Qwen3's per-head q/k norms.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models import lfm2
from areal_jax.models.hf_family import hf_dict, reader, require_fields

HF_CLASSES = {"lfm3": "Lfm3ForCausalLM"}
_DEFAULTS = dict(vocab_size=128_000, hidden_size=2048, intermediate_size=7680, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=128_000,
                 norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=124_894, eos_token_id=124_900, conv_L_cache=7,
                 sliding_window=256, use_sandwich_norm=True, use_attention_gate=True)  # transformers' Lfm3Config
_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
         "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5}}
_TYPES = ("full_attention", "sliding_attention", "conv")


def _default_types(layers: int) -> list[str]:
    return ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
            for i in range(layers)]


def _rope(d: dict) -> tuple[float, dict | None, float]:
    """(the global layers' base, their rope_scaling or None, the sliding layers' base) of rope_parameters: one
    dictionary per layer type (transformers' default where absent), or one flat default RoPE for both."""
    params = d.get("rope_parameters") or _ROPE
    if "full_attention" not in params and "sliding_attention" not in params:  # flat: both kinds alike
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"LFM3's rope_parameters {params}: a RoPE other than the default one is taken per layer "
                             "type here ({'full_attention': {...}, 'sliding_attention': {...}}).")
        theta = float(params.get("rope_theta", _ROPE["full_attention"]["rope_theta"]))
        return theta, None, theta
    full = dict(params.get("full_attention") or _ROPE["full_attention"])
    local = dict(params.get("sliding_attention") or _ROPE["sliding_attention"])
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"LFM3's sliding layers have rope {local}; only the default RoPE is supported there.")
    theta = float(full.pop("rope_theta", _ROPE["full_attention"]["rope_theta"]))
    kind = full.get("rope_type", "default")
    if kind != "proportional" and float(full.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(f"LFM3's global layers have rope {full}: partial rotation is taken with the proportional "
                         "RoPE only.")
    return theta, None if kind == "default" else full, float(local.get("rope_theta", 10_000.0))


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an LFM3 config.json (transformers' defaults where a key is absent)."""
    get = reader(d, _DEFAULTS)

    for key, what in (("conv_bias", "biases in the conv layers"), ("attention_bias", "q/k/v/o biases")):
        if d.get(key):
            raise ValueError(f"{key}=True: LFM3's released checkpoint has no {what}, and they are not supported here.")
    if not get("use_sandwich_norm"):
        raise ValueError("use_sandwich_norm=False is not supported (LFM3's released checkpoint norms after its mixers "
                         "and MLPs too; LFM2 is the form without).")
    layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
    types = list(d.get("layer_types") or _default_types(layers))
    if len(types) != layers or any(t not in _TYPES for t in types):
        raise ValueError(f"LFM3's layer_types hold num_hidden_layers={layers} entries, each one of {', '.join(_TYPES)}; "
                         f"got {types}.")
    theta, scaling, local = _rope(d)
    sliding = "sliding_attention" in types
    eos = get("eos_token_id")
    return cls(architecture=model_type, vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
               intermediate_size=int(get("intermediate_size")), num_layers=layers, num_heads=heads,
               num_kv_heads=int(get("num_key_value_heads") or heads),
               head_dim=int(get("head_dim") or int(get("hidden_size")) // heads), rope_theta=theta,
               rope_scaling=scaling, rms_norm_eps=float(d.get("rms_norm_eps") or get("norm_eps")),
               tie_word_embeddings=bool(d.get("tie_embedding", get("tie_word_embeddings"))),
               max_position_embeddings=int(get("max_position_embeddings")), bos_token_id=get("bos_token_id"),
               eos_token_id=tuple(eos) if isinstance(eos, list) else eos, qk_norm=True,
               sliding_window=int(get("sliding_window")) if sliding else None, layer_types=tuple(types),
               rope_local_theta=local if sliding else None,
               short_conv=int(get("conv_L_cache")) if "conv" in types else None,
               head_gate=bool(get("use_attention_gate")), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' Lfm3ForCausalLM would not load as it is (and LFM3's head gate elsewhere)."""
    if cfg.architecture not in HF_CLASSES:
        if cfg.head_gate:
            raise ValueError(f"head_gate (a per-head output gate, g_proj) is LFM3's; HF {cfg.architecture} has none. "
                             "Use architecture='lfm3'.")
        return
    require_fields(cfg, "LFM3", "attention with per-head q/k norms and no biases, no experts, no other stateful layers "
                   "and no rotation but its proportional RoPE", attention_bias=False, attention_out_bias=False,
                   qk_norm=True, rotary_dim=None, rope_layers=None, linear=None, num_experts=0)
    s = cfg.rope_scaling
    if s is not None and s["rope_type"] != "proportional":
        raise ValueError(f"HF LFM3 takes the default or proportional RoPE on its global layers; got {s}.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an LFM3 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    types = ["conv" if cfg.layer_is_linear(i) else "sliding_attention" if cfg.layer_window(i) is not None
             else "full_attention" for i in range(cfg.num_layers)]
    common = {k: v for k, v in common.items() if k not in ("hidden_act", "rms_norm_eps", "rope_theta")}
    return hf_dict(common, norm_eps=cfg.rms_norm_eps, layer_types=types, conv_L_cache=cfg.short_conv or 7,
                   conv_bias=False, sliding_window=cfg.sliding_window or _DEFAULTS["sliding_window"],
                   rope_parameters={"full_attention": full, "sliding_attention": local}, use_sandwich_norm=True,
                   use_attention_gate=cfg.head_gate, attention_bias=False, pad_token_id=None)


def hf_name(name: str, cfg: Any = None) -> str:
    """LFM3's name of a tensor the weight table names as Llama's (`lfm2.hf_name`'s LFM3 names)."""
    return lfm2.hf_name(name, cfg)
