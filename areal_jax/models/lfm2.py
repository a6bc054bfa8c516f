"""LFM2 (`Lfm2ForCausalLM`: LFM2-350M / 700M / 1.2B / 2.6B) and LFM2-MoE (`Lfm2MoeForCausalLM`: LFM2-8B-A1B): what
their config.json means here (`config_from_hf`, `config_to_hf`, `check_hf`) and their tensors' names (`hf_name`, LFM3's
too); the text decoder of the image-and-text LFM2-VL and LFM3-VL (`text_config`; the vision tower is not loaded).

A pre-norm hybrid: most layers mix tokens with a gated short convolution (`models.short_conv`: "conv" in
layer_types), the others with grouped-query attention with a per-head q/k RMSNorm and full-width RoPE; every layer has
a SwiGLU MLP (w1 the gate, w3 up, w2 down). The final norm is named embedding_norm but sits after the last layer. A
dense LFM2's MLP width is block_ff_dim (or intermediate_size) adjusted as transformers does where
block_auto_adjust_ff_dim is set (2/3 of it, times block_ffn_dim_multiplier, rounded up to a multiple of
block_multiple_of); the config.json written here gives the adjusted width with the adjustment off. LFM2-MoE keeps
num_dense_layers dense layers of intermediate_size first, then experts of moe_intermediate_size in every layer: a
sigmoid router whose top num_experts_per_tok (picked with a per-expert bias, expert_bias, where use_expert_bias is set)
are renormalised where norm_topk_prob says (1e-6 added to the sum, as transformers does) and scaled by
routed_scaling_factor.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, reader, require_fields, text_decoder

HF_CLASSES = {"lfm2": "Lfm2ForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM"}
# the image-and-text models' model_type -> (transformers' class, their text decoder's default model_type)
WRAPPERS = {"lfm2_vl": ("Lfm2VlForConditionalGeneration", "lfm2"), "lfm3_vl": ("Lfm3VlForConditionalGeneration", "lfm3")}
_DEFAULTS = dict(vocab_size=65536, hidden_size=2560, intermediate_size=12288, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=128_000, rms_norm_eps=1e-5,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, conv_L_cache=3, block_multiple_of=256,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True)  # transformers' Lfm2Config
_MOE_DEFAULTS = dict(_DEFAULTS, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792,
                     num_dense_layers=2, num_experts=32, num_experts_per_tok=4, use_expert_bias=True,
                     routed_scaling_factor=1.0, norm_topk_prob=True)  # Lfm2MoeConfig's
_NAMES = ((".input_layernorm.", ".operator_norm."), (".post_attention_layernorm.", ".ffn_norm."),
          (".self_attn.o_proj.", ".self_attn.out_proj."), (".self_attn.q_norm.", ".self_attn.q_layernorm."),
          (".self_attn.k_norm.", ".self_attn.k_layernorm."), (".mlp.gate.e_score_correction_bias", ".mlp.expert_bias"),
          (".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."), (".mlp.", ".feed_forward."),
          (".linear_attn.", ".conv."), ("model.norm.", "model.embedding_norm."))
# LFM3's: its attention's as Qwen3's, a norm after each of the mixer and the MLP besides the ones before
_LFM3_NAMES = ((".input_layernorm.", ".operator_norm."), (".post_attention_layernorm.", ".post_operator_norm."),
               (".pre_feedforward_layernorm.", ".ffn_norm."), (".post_feedforward_layernorm.", ".post_ffn_norm."),
               (".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."), (".mlp.", ".feed_forward."),
               (".linear_attn.", ".conv."), ("model.norm.", "model.embedding_norm."))
RENAMED = {"lfm2": _NAMES, "lfm2_moe": _NAMES, "lfm3": _LFM3_NAMES}  # the families whose tensors these names name


def hf_name(name: str, cfg: Any = None) -> str:
    """The LFM2 (or LFM3: `cfg`'s architecture) name of a tensor the weight table names as Llama / Gemma / Qwen3-MoE
    do (`hf_names.weight_entries`), as a checkpoint holds it (LFM3's head gate is self_attn.gate_proj on disk,
    self_attn.g_proj in transformers' module: `disk_names.in_memory`)."""
    for ours, theirs in RENAMED["lfm2" if cfg is None else cfg.architecture]:
        name = name.replace(ours, theirs)
    return name.replace(".self_attn.g_proj.", ".self_attn.gate_proj.")


def text_config(d: dict) -> tuple[dict, str]:
    """(the text decoder's config.json keys, its model_type) of an LFM2-VL / LFM3-VL config: its text_config, with the
    outer file's special tokens where it has none; whether the output matrix is the embedding is the outer file's
    (tie_embedding, else tie_word_embeddings: transformers ties these models' weights by the outer config)."""
    cls, default = WRAPPERS[d["model_type"]]
    inner = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    model_type = inner.get("model_type") or default
    tied = d.get("tie_embedding", d.get("tie_word_embeddings", True))
    text = text_decoder({**d, "tie_word_embeddings": tied}, cls, model_type, tied=True)
    text.pop("tie_embedding", None)
    return text, model_type


def mlp_width(get: Any) -> int:
    """A dense LFM2's MLP width from its config.json (`get(key)`: the value, or transformers' default)."""
    width = int(get("block_ff_dim") or get("intermediate_size"))
    if get("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        if get("block_ffn_dim_multiplier") is not None:
            multiple = int(get("block_multiple_of"))
            width = multiple * ((int(float(get("block_ffn_dim_multiplier")) * width) + multiple - 1) // multiple)
    return width


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an LFM2 or LFM2-MoE config.json (transformers' defaults where a key is absent)."""
    moe = model_type == "lfm2_moe"
    defaults = _MOE_DEFAULTS if moe else _DEFAULTS
    get = reader(d, defaults)
    tied = d.get("tie_embedding", d.get("tie_word_embeddings", defaults["tie_word_embeddings"]))
    own = {**d, "rms_norm_eps": get("norm_eps") or defaults["rms_norm_eps"], "tie_word_embeddings": tied,
           "intermediate_size": get("intermediate_size") if moe else mlp_width(get)}
    fields, get = common_fields(own, model_type, defaults, "LFM2")
    if "rope_theta" not in d and "rope_theta" not in (d.get("rope_parameters") or {}):
        fields["rope_theta"] = 1_000_000.0  # Lfm2Config's default base
    if d.get("conv_bias"):
        raise ValueError("conv_bias=True: LFM2's released checkpoints have no biases in their conv layers, and those "
                         "biases are not supported here.")
    layers = fields["num_layers"]
    attention = d.get("full_attn_idxs")
    types = d.get("layer_types") or ["full_attention" if attention is None or i in attention else "conv"
                                     for i in range(layers)]
    if any(t not in ("full_attention", "conv") for t in types) or len(types) != layers:
        raise ValueError(f"LFM2's layer_types hold num_hidden_layers={layers} entries, each full_attention or conv; got "
                         f"{types}.")
    conv = "conv" in types
    fields.update(layer_types=tuple(types), short_conv=int(get("conv_L_cache")) if conv else None, qk_norm=True)
    if moe:
        dense = int(get("num_dense_layers"))
        fields.update(num_experts=int(get("num_experts")), num_experts_per_tok=int(get("num_experts_per_tok")),
                      moe_intermediate_size=int(get("moe_intermediate_size")), norm_topk_prob=bool(get("norm_topk_prob")),
                      moe_layers=tuple(int(i >= dense) for i in range(layers)), router_scoring="sigmoid",
                      router_score_bias=bool(get("use_expert_bias")),
                      routed_scaling_factor=float(get("routed_scaling_factor")))
    return cls(**fields, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' LFM2 classes would not load as it is (and short convolutions elsewhere)."""
    if cfg.architecture not in HF_CLASSES:
        if cfg.short_conv is not None and cfg.architecture not in RENAMED:
            raise ValueError(f"short_conv (conv layers) is LFM2's and LFM3's; HF {cfg.architecture} has none. Use "
                             "architecture='lfm2', 'lfm2_moe' or 'lfm3'.")
        return
    require_fields(cfg, "LFM2", "attention with a per-head q/k norm and no biases, full-width RoPE in every attention "
                   "layer, no windows and no other stateful layers", attention_bias=False, qk_norm=True, rotary_dim=None,
                   sliding_window=None, rope_layers=None, linear=None, shared_expert_size=None, expert_bias=False)
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise ValueError(f"HF LFM2 has head_dim = hidden_size / num_heads ({cfg.hidden_size // cfg.num_heads}); got "
                         f"{cfg.head_dim}.")
    if cfg.architecture == "lfm2_moe":
        moe = [cfg.layer_is_moe(i) for i in range(cfg.num_layers)]
        dense = moe.index(True) if True in moe else cfg.num_layers
        if not all(moe[dense:]) or cfg.router_scoring != "sigmoid":
            raise ValueError("HF LFM2-MoE has dense layers first, then experts in every layer, picked by a sigmoid "
                             "router; set moe_layers and router_scoring='sigmoid' so.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an LFM2 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    types = ["conv" if cfg.layer_is_linear(i) else "full_attention" for i in range(cfg.num_layers)]
    common = {k: v for k, v in common.items() if k not in ("head_dim", "hidden_act", "rms_norm_eps")}
    own = dict(norm_eps=cfg.rms_norm_eps, layer_types=types, conv_L_cache=cfg.short_conv or 3, conv_bias=False,
               pad_token_id=0)
    if cfg.architecture == "lfm2":
        return hf_dict(common, **own, block_auto_adjust_ff_dim=False)
    dense = [cfg.layer_is_moe(i) for i in range(cfg.num_layers)].index(True)
    return hf_dict(common, **own, num_dense_layers=dense, num_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.expert_size,
                   use_expert_bias=cfg.router_score_bias, norm_topk_prob=cfg.norm_topk_prob,
                   routed_scaling_factor=cfg.routed_scaling_factor, output_router_logits=False)

