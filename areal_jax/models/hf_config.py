"""HF config.json in and out for ModelConfig (`ModelConfig.from_hf_dict` / `to_hf_dict` call these): each family's
keys read as its transformers class reads them, and written so that class loads them again."""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

import jax.numpy as jnp

from areal_jax.models import granite_swa, lfm2, ministral3, qwen3_5, qwen3_vl
from areal_jax.models.base_families import BASE, Written, attention_layout, hf_experts
from areal_jax.models.config import ARCHITECTURES, _dtype_name
from areal_jax.models.families import OWN_MODULES
from areal_jax.models.hf_checks import GRANITE_SCALARS, check_loadable
from areal_jax.models.hf_family import rope_of, text_decoder

_OWN_MODULE = {arch: m for m in OWN_MODULES for arch in m.HF_CLASSES}
_HF_CLASS = {**{arch: family.hf_class for arch, family in BASE.items()},  # every family's transformers class
             **{arch: m.HF_CLASSES[arch] for arch, m in _OWN_MODULE.items()}}
_HF_MODEL_TYPE = {arch: family.model_type for arch, family in BASE.items() if family.model_type}  # where they differ
# model types of checkpoints whose own (remote) code runs a transformers family's layers plus parts left out here:
# (the family read, what is left out). The config reads as that family's, and is saved as it.
READ_AS = {"mimo": ("qwen2", "MiMo's multi-token-prediction layers (model.mtp_layers, num_nextn_predict_layers) are "
                             "left out: the model runs, trains and is saved as Qwen2")}


def read_config_json(path: str | os.PathLike) -> dict:
    """The contents of `<path>/config.json`, an HF checkpoint directory's; a missing directory, file or bad JSON says
    which."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist; pass the folder that holds "
                                "config.json and the *.safetensors files.")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file!r} is missing; an HF checkpoint directory needs a config.json.")
    with open(file) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file!r} is not valid JSON: {err}.") from err


def config_from_hf(cls: type, d: dict, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32) -> Any:
    """Builds a config from the contents of an HF config.json (old or new rope layout)."""
    model_type = d.get("model_type")
    if model_type is None:
        archs = d.get("architectures") or []
        inverse: dict[str, str] = {}
        for arch, name in _HF_CLASS.items():  # (the first family of a class: LlamaForCausalLM is llama's, not EXAONE's)
            inverse.setdefault(name, arch)
        model_type = next((inverse[a] for a in archs if a in inverse), None)
    d, model_type = (qwen3_5.text_config(d), f"{model_type}_text") if model_type in qwen3_5.WRAPPERS else (d, model_type)
    d, model_type = ministral3.text_config(d) if model_type == ministral3.WRAPPER else (d, model_type)
    if model_type in (qwen3_vl.WRAPPER, qwen3_vl.MOE_WRAPPER):
        d, model_type = qwen3_vl.text_config(d)
    if model_type in lfm2.WRAPPERS:  # LFM2-VL, LFM3-VL
        d, model_type = lfm2.text_config(d)
    if model_type == "gemma3":  # the image-and-text model (4B and up): its text decoder, under text_config
        return config_from_hf(cls, text_decoder(d, "Gemma3ForConditionalGeneration", "gemma3_text", tied=True),
                              dtype=dtype, param_dtype=param_dtype)
    model_type = {v: k for k, v in _HF_MODEL_TYPE.items()}.get(model_type, model_type)
    if model_type in READ_AS:
        family, left_out = READ_AS[model_type]
        warnings.warn(f"model_type={model_type!r}: {left_out}.", stacklevel=3)
        d, model_type = {**d, "model_type": family}, family
    if model_type not in ARCHITECTURES:
        raise ValueError(f"Unknown architecture: model_type={d.get('model_type')!r}, architectures={d.get('architectures')!r}; "
                         f"supported model types are {', '.join(_HF_MODEL_TYPE.get(a, a) for a in ARCHITECTURES)}; read as "
                         f"others: {', '.join(f'{k} (as {v[0]})' for k, v in READ_AS.items())}.")
    if model_type in _OWN_MODULE:
        return _OWN_MODULE[model_type].config_from_hf(cls, d, model_type, dtype=dtype, param_dtype=param_dtype)
    return _base_config(cls, d, model_type, dtype, param_dtype)


def _base_config(cls: type, d: dict, model_type: str, dtype: Any, param_dtype: Any) -> Any:
    """A config of one of `base_families.BASE`'s families, read as its row says its transformers class reads it."""
    family = BASE[model_type]
    d = {**(family.defaults or {}), **{new: d[old] for old, new in (family.aliases or {}).items() if old in d}, **d}
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"HF config for {model_type} lacks required keys {', '.join(missing)}.")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported (the MLP projections here have no bias).")
    gemma = family.gemma
    act = d.get("hidden_activation") or d.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    wanted_act = "gelu_pytorch_tanh" if gemma else "silu"
    if act != wanted_act:
        raise ValueError(f"hidden activation {act!r} is not supported for {model_type}; only {wanted_act!r} is.")
    if gemma:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(key) is not None and family.softcaps is None:
                raise ValueError(f"{key}={d[key]} (Gemma 2's tanh soft-capping) is not supported; {model_type} "
                                 "checkpoints have it null.")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True (an encoder) is not supported; a decoder is "
                             "causal.")
    if d.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={d['clip_qkv']} (clamping q/k/v) is not supported for {model_type}; its released "
                         "checkpoints have it null.")
    if family.attention_bias is None:  # q/k/v biases by default (and gpt-oss's o_proj one with them)
        attention_bias = bool(d.get("attention_bias", True))
    elif not family.attention_bias and d.get("attention_bias"):
        raise ValueError(f"attention_bias=True for {model_type} also adds an o_proj bias, which is not supported.")
    else:
        attention_bias = family.attention_bias
    num_layers = d["num_hidden_layers"]
    max_pos = int(d.get("max_position_embeddings", 4096))
    window, layer_types = attention_layout(d, family, num_layers, max_pos)
    rope, local_theta = rope_of(d, family.local_base)
    softcaps = (d.get("attn_logit_softcapping", family.softcaps[0]), d.get("final_logit_softcapping", family.softcaps[1])) \
        if family.softcaps else (None, None)
    theta = rope.pop("rope_theta", d.get("rope_theta", family.default_theta))
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    partial = rope.pop("partial_rotary_factor", d.get("partial_rotary_factor"))
    partial = float(partial or (family.partial_default and family.partial_default(d, head_dim)) or 1.0)
    if partial != 1.0 and not family.partial:
        raise ValueError(f"partial_rotary_factor != 1 is not supported for {model_type} (Phi-3's, GLM-4's, "
                         "GLM-4.5's and MiniMax-M2's are).")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if family.longrope_aliases and rope_type in ("su", "yarn"):  # Phi-3's older names, as transformers reads them
        rope_type = rope["rope_type"] = "longrope"
        rope.pop("type", None)
    if rope_type == "longrope":
        rope.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings", 4096))
    rope_layers = _no_rope_layers(d, num_layers) if family.no_rope_layers else None
    if family.layer_thetas:  # (Granite SWA's RoPE base per layer)
        theta, local_theta, rope_layers = granite_swa.layer_thetas(d, layer_types, float(theta), rope_type != "default")
    return cls(
        architecture=model_type,
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=float(theta),
        rope_scaling=None if rope_type == "default" else rope,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
        attention_bias=attention_bias,
        qk_norm=family.qk_norm,
        max_position_embeddings=max_pos,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)) if gemma else None,
        rope_layers=rope_layers, **({"attention_sinks": True} if family.sinks else {}),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None, rope_interleave=family.rope_interleave,
        attn_logit_softcap=None if softcaps[0] is None else float(softcaps[0]),
        final_logit_softcap=None if softcaps[1] is None else float(softcaps[1]),
        **hf_experts(d, family, model_type, num_layers),
        **({k: float(d.get(k, 1.0)) for k in GRANITE_SCALARS} if family.granite else {}),
        dtype=dtype,
        param_dtype=param_dtype,
    )


def _no_rope_layers(d: dict, num_layers: int) -> tuple[int, ...] | None:
    """SmolLM3's per-layer RoPE flags (no_rope_layers: 1 rotates, 0 does not; by default every
    no_rope_layer_interval-th layer does not); None where every layer rotates."""
    flags = d.get("no_rope_layers") or [int((i + 1) % int(d.get("no_rope_layer_interval", 4)) != 0)
                                         for i in range(num_layers)]
    return None if all(flags) else tuple(int(x) for x in flags)


def config_to_hf(cfg: Any) -> dict:
    """A config.json dictionary that transformers loads as the matching *ForCausalLM model."""
    check_loadable(cfg)
    sliding = any(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
    rope_parameters = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        rope_parameters.update(cfg.rope_scaling)
        rope_parameters.pop("use_long_factor", None)  # this run's choice (ModelConfig.for_sequence_length)
        for key in ("short_factor", "long_factor"):
            if key in rope_parameters:
                rope_parameters[key] = list(rope_parameters[key])
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    types = [("sliding_attention" if cfg.layer_window(i) is not None else "full_attention")
             for i in range(cfg.num_layers)]
    d = {
        "architectures": [_HF_CLASS[cfg.architecture]],
        "model_type": _HF_MODEL_TYPE.get(cfg.architecture, cfg.architecture),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "gelu_pytorch_tanh" if cfg.gemma else "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else dict(cfg.rope_scaling),  # a copy: HF edits it
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": _dtype_name(cfg.param_dtype),
    }
    if cfg.architecture in _OWN_MODULE:
        return _OWN_MODULE[cfg.architecture].config_to_hf(cfg, d)
    family = BASE[cfg.architecture]
    if family.attention_bias is False:
        d["attention_bias"] = False
    family.write(cfg, d, Written(sliding, types, rope_parameters))
    return d
