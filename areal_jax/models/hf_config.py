"""HF config.json in and out for ModelConfig (`ModelConfig.from_hf_dict` / `to_hf_dict` call these): each family's
keys read as its transformers class reads them, and written so that class loads them again."""
from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp

from areal_jax.models import glm4, gpt_oss, lfm2, minimax, ministral3, qwen3_5, qwen3_vl
from areal_jax.models.config import ARCHITECTURES, _dtype_name
from areal_jax.models.families import OWN_MODULES
from areal_jax.models.hf_checks import GRANITE_SCALARS, check_loadable
from areal_jax.models.hf_family import text_decoder

_HF_CLASS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "mistral":
             "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
             "olmo3": "Olmo3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen3_moe":
             "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "granite": "GraniteForCausalLM", "granitemoe":
             "GraniteMoeForCausalLM", "olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "gpt_oss":
             "GptOssForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM", "glm4": "Glm4ForCausalLM"}
_OWN_MODULE = {arch: m for m in OWN_MODULES for arch in m.HF_CLASSES}
_HF_CLASS.update({arch: m.HF_CLASSES[arch] for arch, m in _OWN_MODULE.items()})  # families whose modules read and write
_HF_MODEL_TYPE = {"gemma3": "gemma3_text"}  # architecture -> HF model_type where the two differ
# transformers' Gemma3TextConfig defaults: the image-and-text checkpoints' text_config lists only the keys that differ
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "bos_token_id": 2, "eos_token_id": 1}


def _hf_attention_layout(d: dict, model_type: str, num_layers: int,
                         max_pos: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of an HF config, as its model class applies them: Mistral slides every
    layer when sliding_window is set; Qwen2 / Qwen3 slide the layers `layer_types` names (by default those from
    max_window_layers on) when use_sliding_window is set; Gemma 3 slides all but every sliding_window_pattern-th
    layer, OLMo 3 all but every fourth. Outside Gemma and OLMo 3 (whose layer types also pick each layer's RoPE),
    a window at least as long as the model's context is dropped (it would change nothing)."""
    if model_type in ("llama", "olmo2", "granite", "granitemoe", "olmoe", "minimax_m2", "glm4"):
        return None, None
    window = d.get("sliding_window")
    if model_type in ("mistral", "phi3", "mixtral"):
        types = None
    elif model_type == "qwen3_moe":  # every layer slides when use_sliding_window is set
        if not d.get("use_sliding_window"):
            return None, None
        types = None
    elif model_type in ("qwen2", "qwen3", "smollm3", "qwen2_moe"):
        if not d.get("use_sliding_window"):
            return None, None
        types = d.get("layer_types") or [
            "sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention"
            for i in range(num_layers)]
    else:  # gemma2, gemma3, olmo3, gpt_oss
        window = d.get("sliding_window", 128 if model_type == "gpt_oss" else 4096)
        pattern = {"gemma3": int(d.get("sliding_window_pattern", 6)), "gemma2": 2, "gpt_oss": 2}.get(model_type, 4)
        types = d.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    types = tuple(types) if types is not None else None
    if model_type in ("gemma3", "olmo3"):  # their layer types also choose each layer's RoPE: kept whatever the window
        return int(window or max_pos), types
    if model_type == "gemma2" and window is None:
        return None, None
    if window is None or int(window) >= max_pos:
        return None, None
    if types is not None and "sliding_attention" not in types:
        return None, None
    return int(window), types


def _hf_rope_layers(d: dict, model_type: str, num_layers: int) -> tuple[int, ...] | None:
    """SmolLM3's per-layer RoPE flags (no_rope_layers: 1 rotates, 0 does not; by default every
    no_rope_layer_interval-th layer does not); None for the other families (every layer rotates)."""
    if model_type != "smollm3":
        return None
    flags = d.get("no_rope_layers") or [int((i + 1) % int(d.get("no_rope_layer_interval", 4)) != 0)
                                         for i in range(num_layers)]
    return None if all(flags) else tuple(int(x) for x in flags)


def _hf_rope(d: dict, model_type: str) -> tuple[dict, float | None]:
    """(the global layers' rope parameters, the sliding layers' own rope base or None) of an HF config: a flat
    rope_parameters / rope_scaling, or Gemma 3's / OLMo 3's per-layer-type dictionary (their sliding layers take
    the default RoPE of their own base: Gemma's rope_local_base_freq, OLMo 3's rope_theta without the global
    layers' scaling)."""
    params = dict(d.get("rope_parameters") or {})
    local = None
    if model_type in ("gemma3", "olmo3"):
        if "full_attention" in params or "sliding_attention" in params:
            local_params = dict(params.get("sliding_attention") or {})
            params = dict(params.get("full_attention") or {})
            if local_params.get("rope_type", "default") != "default":
                raise ValueError(f"The sliding layers have rope {local_params}; only the default RoPE is supported "
                                 "there.")
            local = local_params.get("rope_theta")
        fallback = d.get("rope_local_base_freq", 10000.0) if model_type == "gemma3" else \
            params.get("rope_theta", d.get("rope_theta", 500_000.0))
        local = float(local if local is not None else fallback)
    if d.get("rope_scaling"):
        params.update(d["rope_scaling"])
    return params, local


def _hf_experts(d: dict, model_type: str, num_layers: int) -> dict:
    """ModelConfig's mixture-of-experts fields of an HF config (none for the dense families): Qwen3-MoE's experts
    in every decoder_sparse_step-th layer outside mlp_only_layers; Mixtral's in every layer, of intermediate_size,
    their weights always renormalised."""
    if model_type not in ("qwen3_moe", "mixtral", "granitemoe", "olmoe", "qwen2_moe"):
        return {}
    experts = d.get("num_experts", d.get("num_local_experts"))  # transformers writes Qwen3-MoE's as the latter
    if not experts or not d.get("num_experts_per_tok"):
        raise ValueError(f"HF config for {model_type} needs num_experts (or num_local_experts) and "
                         "num_experts_per_tok.")
    out = dict(num_experts=int(experts), num_experts_per_tok=int(d["num_experts_per_tok"]))
    if model_type in ("mixtral", "granitemoe"):  # Granite's softmax over the top-k logits: renormalised weights
        return {**out, "norm_topk_prob": True}
    if model_type == "olmoe":  # experts of intermediate_size in every layer
        return {**out, "norm_topk_prob": bool(d.get("norm_topk_prob", False))}
    step, dense_only = int(d.get("decoder_sparse_step", 1) or 1), set(d.get("mlp_only_layers") or ())
    flags = tuple(int(i not in dense_only and (i + 1) % step == 0) for i in range(num_layers))
    if model_type == "qwen2_moe":
        out["shared_expert_size"] = int(d.get("shared_expert_intermediate_size") or 0) or None
    return {**out, "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "moe_intermediate_size": int(d.get("moe_intermediate_size") or d["intermediate_size"]),
            "moe_layers": None if all(flags) else flags}


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
    if model_type == "gemma3":  # keys a Gemma 3 config.json leaves out take transformers' defaults
        d = {**_GEMMA3_TEXT_DEFAULTS, **d}
    if model_type not in ARCHITECTURES:
        raise ValueError(f"Unknown architecture: model_type={d.get('model_type')!r}, architectures={d.get('architectures')!r}; "
                         f"supported model types are {', '.join(_HF_MODEL_TYPE.get(a, a) for a in ARCHITECTURES)}.")
    if model_type in _OWN_MODULE:
        return _OWN_MODULE[model_type].config_from_hf(cls, d, model_type, dtype=dtype, param_dtype=param_dtype)
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"HF config for {model_type} lacks required keys {', '.join(missing)}.")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported (the MLP projections here have no bias).")
    gemma = model_type in ("gemma2", "gemma3")
    act = d.get("hidden_activation") or d.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    wanted_act = "gelu_pytorch_tanh" if gemma else "silu"
    if act != wanted_act:
        raise ValueError(f"hidden activation {act!r} is not supported for {model_type}; only {wanted_act!r} is.")
    if gemma:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(key) is not None and model_type == "gemma3":
                raise ValueError(f"{key}={d[key]} (Gemma 2's tanh soft-capping) is not supported; Gemma 3 "
                                 "checkpoints have it null.")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True (an encoder) is not supported; a decoder is "
                             "causal.")
    if model_type == "olmoe" and d.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={d['clip_qkv']} (clamping q/k/v) is not supported; OLMoE's released checkpoints "
                         "have it null.")
    if model_type in ("qwen2", "qwen2_moe"):
        attention_bias = True
    elif model_type in ("gpt_oss", "glm4"):  # q/k/v biases by default (and gpt-oss's o_proj one with them)
        attention_bias = bool(d.get("attention_bias", True))
    else:
        if d.get("attention_bias"):
            raise ValueError(f"attention_bias=True for {model_type} also adds an o_proj bias, which is not "
                             "supported.")
        attention_bias = False
    num_layers = d["num_hidden_layers"]
    max_pos = int(d.get("max_position_embeddings", 4096))
    window, layer_types = _hf_attention_layout(d, model_type, num_layers, max_pos)
    rope, local_theta = _hf_rope(d, model_type)
    default_theta = {"gemma3": 1e6, "olmo3": 5e5, "gpt_oss": 1.5e5, "minimax_m2": 5e6}.get(model_type, 10000.0)
    softcaps = {"gemma2": (d.get("attn_logit_softcapping", 50.0), d.get("final_logit_softcapping", 30.0))}.get(
        model_type, (None, None))
    theta = rope.pop("rope_theta", d.get("rope_theta", default_theta))
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    partial = rope.pop("partial_rotary_factor", d.get("partial_rotary_factor"))
    partial = float(partial or {"minimax_m2": minimax.partial_factor(d, head_dim), "glm4": glm4.PARTIAL_ROTARY}.get(
        model_type) or 1.0)
    if partial != 1.0 and model_type not in ("phi3", "minimax_m2", "glm4"):
        raise ValueError(f"partial_rotary_factor != 1 is not supported for {model_type} (Phi-3's, GLM-4's, "
                         "GLM-4.5's and MiniMax-M2's are).")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):  # Phi-3's older names of LongRoPE, as transformers reads them
        rope_type = rope["rope_type"] = "longrope"
        rope.pop("type", None)
    if rope_type == "longrope":
        rope.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings", 4096))
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
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "olmo2", "olmo3", "olmoe", "minimax_m2"),
        max_position_embeddings=max_pos,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)) if gemma else None,
        rope_layers=_hf_rope_layers(d, model_type, num_layers),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None, rope_interleave=model_type == "glm4",
        attn_logit_softcap=None if softcaps[0] is None else float(softcaps[0]),
        final_logit_softcap=None if softcaps[1] is None else float(softcaps[1]),
        **({"gpt_oss": gpt_oss.hf_fields, "minimax_m2": minimax.hf_fields}.get(
            model_type, lambda d: _hf_experts(d, model_type, num_layers))(d)),
        **({k: float(d.get(k, 1.0)) for k in GRANITE_SCALARS} if model_type.startswith("granite") else {}),
        dtype=dtype,
        param_dtype=param_dtype,
    )


def config_to_hf(cfg: Any) -> dict:
    """A config.json dictionary that transformers loads as the matching *ForCausalLM model."""
    check_loadable(cfg)
    sliding = any(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
    granite = cfg.architecture in ("granite", "granitemoe")
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
    if cfg.architecture not in ("qwen2", "qwen2_moe", "gpt_oss"):
        d["attention_bias"] = False
    if cfg.architecture == "llama":
        d["mlp_bias"] = False
    elif cfg.architecture == "mistral":
        d["sliding_window"] = cfg.sliding_window if sliding else None
    elif cfg.architecture == "mixtral":
        d.update(sliding_window=cfg.sliding_window if sliding else None, num_local_experts=cfg.num_experts,
                 num_experts_per_tok=cfg.num_experts_per_tok, router_jitter_noise=0.0, output_router_logits=False)
    elif granite:
        d.update(mlp_bias=False, embedding_multiplier=cfg.embedding_multiplier or 1.0,
                 residual_multiplier=cfg.residual_multiplier or 1.0, logits_scaling=cfg.logits_scaling or 1.0,
                 attention_multiplier=cfg.attention_multiplier or cfg.head_dim ** -0.5)
        if cfg.architecture == "granitemoe":
            d.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                     output_router_logits=False)
    elif cfg.architecture == "gpt_oss":
        d.update(gpt_oss.hf_dict(cfg, sliding, types))
    elif cfg.architecture in ("minimax_m2", "glm4"):
        d.update({"minimax_m2": minimax, "glm4": glm4}[cfg.architecture].hf_dict(cfg), **glm4.partial_rotary_keys(cfg, d))
    elif cfg.architecture == "olmoe":
        if cfg.expert_size != cfg.intermediate_size:
            raise ValueError("HF OLMoE's experts are of intermediate_size; set moe_intermediate_size=None.")
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 norm_topk_prob=cfg.norm_topk_prob, clip_qkv=None, output_router_logits=False, pad_token_id=None)
    elif cfg.architecture in ("qwen3_moe", "qwen2_moe"):
        dense = [i for i in range(cfg.num_layers) if not cfg.layer_is_moe(i)]
        d.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window if sliding else None,
                 num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.expert_size, norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
                 mlp_only_layers=dense, output_router_logits=False)
        if cfg.architecture == "qwen2_moe":
            d.update(shared_expert_intermediate_size=cfg.shared_expert_size or 0, qkv_bias=True,
                     layer_types=types, max_window_layers=types.index("sliding_attention") if sliding else cfg.num_layers)
    elif cfg.architecture == "phi3":
        d.update(sliding_window=cfg.sliding_window if sliding else None, rope_scaling=None, **glm4.partial_rotary_keys(cfg, d),
                 pad_token_id=None,  # its default (32000) lies outside a small vocabulary
                 original_max_position_embeddings=int(rope_parameters.get("original_max_position_embeddings",
                                                                           cfg.max_position_embeddings)))
    elif cfg.architecture == "gemma2":
        scalar = float(cfg.query_pre_attn_scalar or cfg.head_dim)
        d.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(scalar) if scalar.is_integer() else
                 scalar, sliding_window=cfg.sliding_window or cfg.max_position_embeddings, layer_types=types,
                 attn_logit_softcapping=cfg.attn_logit_softcap, final_logit_softcapping=cfg.final_logit_softcap)
    elif cfg.gemma:
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        if cfg.rope_local_theta is None:
            local = dict(rope_parameters)
        d.pop("rope_scaling")
        scalar = float(cfg.query_pre_attn_scalar or cfg.head_dim)
        d.update(hidden_activation="gelu_pytorch_tanh",
                 query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar, sliding_window=cfg.sliding_window or cfg.max_position_embeddings,
                 layer_types=types, rope_local_base_freq=local["rope_theta"],
                 rope_parameters={"full_attention": rope_parameters, "sliding_attention": local},
                 attn_logit_softcapping=None, final_logit_softcapping=None)
    elif cfg.architecture == "olmo3":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        d.pop("rope_scaling")
        d.update(sliding_window=cfg.sliding_window or cfg.max_position_embeddings, layer_types=types,
                 rope_parameters={"full_attention": rope_parameters, "sliding_attention": local})
    elif cfg.architecture != "olmo2":
        if cfg.architecture == "smollm3":
            d.update(no_rope_layers=list(cfg.rope_layers or (1,) * cfg.num_layers), mlp_bias=False,
                     pad_token_id=None)  # its default (128004) lies outside a smaller vocabulary
        d["use_sliding_window"] = sliding
        d["sliding_window"] = cfg.sliding_window if sliding else None
        d["layer_types"] = types
        d["max_window_layers"] = types.index("sliding_attention") if sliding else cfg.num_layers
    return d

