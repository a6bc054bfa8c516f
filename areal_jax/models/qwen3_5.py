"""Qwen3.5 (`Qwen3_5ForCausalLM`, and the text decoder of `Qwen3_5ForConditionalGeneration`: Qwen3.5-0.8B / 2B / 4B /
9B / 27B) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM` / `Qwen3_5MoeForConditionalGeneration`: Qwen3.5-35B-A3B,
122B-A10B, 397B-A17B): what their config.json means here (`config_from_hf`, `config_to_hf`, `check_hf`).

Three of every four layers (by default; `layer_types` on disk) are Gated DeltaNet layers (`models.gated_deltanet`),
the others attention with a per-head q/k norm, RoPE on the first quarter of each head (partial_rotary_factor) and an
output gate: q_proj gives each head's query and then its gate, and the attention's output is times sigmoid(gate)
(`Attention.gated_qkv`). Every RMSNorm but the Gated DeltaNet's own scales by 1 + w. The image-and-text checkpoints'
multimodal RoPE (mrope_section) rotates text positions exactly as plain RoPE does, so text-only use reads it as
that; their vision tower is not loaded. The MoE's feed-forward is Qwen2-MoE's in every layer (a softmax router,
the top `num_experts_per_tok` renormalised, and a shared expert times sigmoid(x . shared_expert_gate)), one tensor per
expert on disk (`mlp.experts.{j}.gate_proj` ..., as transformers writes them; its class stacks them on loading).
Qwen3-Next (`Qwen3NextForCausalLM`: Qwen3-Next-80B-A3B) is the MoE's layer with its q, k, v, z projections fused in
one in_proj_qkvz and b, a in one in_proj_ba, each key head's parts side by side (split on loading, fused again on
saving: `hf_names`), dense MLP layers where `mlp_only_layers` / `decoder_sparse_step` say, and plain partial RoPE.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.config_checks import LinearAttention
from areal_jax.models.hf_family import common_fields, hf_dict, require_fields, text_decoder
from areal_jax.models.tensor_layout import Layout

HF_CLASSES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
              "qwen3_next": "Qwen3NextForCausalLM"}
LAYOUTS = {"qwen3_next": Layout(linear="qkvz")}  # (Qwen3.5's own: the default)
WRAPPERS = ("qwen3_5", "qwen3_5_moe")  # the image-and-text models' model_type: the text decoder under text_config
_DEFAULTS = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=256, max_position_embeddings=32768,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                 full_attention_interval=4)  # transformers' Qwen3_5TextConfig, where a config.json leaves a key out
_MOE_DEFAULTS = dict(_DEFAULTS, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, num_experts=256,
                     num_experts_per_tok=8, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512)  # Qwen3_5MoeTextConfig's (it has no intermediate_size)
_NEXT_DEFAULTS = dict(_DEFAULTS, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                      num_key_value_heads=2, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                      shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True,
                      tie_word_embeddings=False)  # Qwen3NextConfig's
_ROPE_EXTRAS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def text_config(d: dict) -> dict:
    """The text decoder's config.json keys: `d` itself, or an image-and-text config's text_config (with the outer
    file's special tokens where the inner one has none)."""
    if d.get("model_type") not in WRAPPERS:
        return d
    return text_decoder(d, "an image-and-text Qwen3.5", f"{d['model_type']}_text", tied=False)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Qwen3.5 config.json (transformers' defaults where a key is absent)."""
    d = text_config(d)
    moe, nxt = model_type in ("qwen3_5_moe_text", "qwen3_next"), model_type == "qwen3_next"
    defaults = _NEXT_DEFAULTS if nxt else _MOE_DEFAULTS if moe else _DEFAULTS
    if moe and not nxt:  # no dense MLP anywhere: intermediate_size (which ModelConfig needs) is the experts' width
        d = {**d, "intermediate_size": d.get("moe_intermediate_size", defaults["moe_intermediate_size"])}
    rope = dict(d.get("rope_parameters") or {})
    factor = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
    plain = {**d, "rope_parameters": {k: v for k, v in rope.items() if k not in _ROPE_EXTRAS},
             "partial_rotary_factor": None}
    fields, get = common_fields(plain, model_type, defaults, "Qwen3.5")
    if d.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported (q_proj's output gate takes no bias here); the released "
                         "Qwen3.5 checkpoints have none.")
    layers, interval = fields["num_layers"], int(get("full_attention_interval"))
    types = tuple(d.get("layer_types") or ("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                           for i in range(layers)))
    linear = LinearAttention(int(get("linear_num_key_heads")), int(get("linear_num_value_heads")),
                             int(get("linear_key_head_dim")), int(get("linear_value_head_dim")),
                             int(get("linear_conv_kernel_dim")))
    rotary = int(fields["head_dim"] * factor)
    if moe:
        fields.update(num_experts=int(get("num_experts")), num_experts_per_tok=int(get("num_experts_per_tok")),
                      moe_intermediate_size=int(get("moe_intermediate_size")), norm_topk_prob=True,
                      shared_expert_size=int(get("shared_expert_intermediate_size")), shared_expert_gated=True)
    if nxt:  # experts in every decoder_sparse_step-th layer outside mlp_only_layers, dense MLPs elsewhere
        step, dense = int(get("decoder_sparse_step") or 1), set(d.get("mlp_only_layers") or ())
        flags = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
        fields.update(norm_topk_prob=bool(get("norm_topk_prob")), moe_layers=None if all(flags) else flags)
    return cls(**fields, qk_norm=True, rotary_dim=None if rotary == fields["head_dim"] else rotary, layer_types=types,
               linear=linear if "linear_attention" in types else None, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' Qwen3_5ForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Qwen3.5", "per-head q/k norm, no biases, and no windows or layers without RoPE", qk_norm=True,
                   attention_bias=False, sliding_window=None, rope_layers=None)
    if cfg.architecture == "qwen3_next":
        require_fields(cfg, "Qwen3-Next", "softmax routing and a gated shared expert", router_scoring="softmax",
                       shared_expert_gated=True)
    elif cfg.num_experts:
        require_fields(cfg, "Qwen3.5-MoE", "experts in every layer, renormalised, and a gated shared expert",
                       moe_layers=None, norm_topk_prob=True, router_scoring="softmax", shared_expert_gated=True)
    if cfg.num_experts:
        if cfg.shared_expert_size is None:
            raise ValueError("HF Qwen3.5-MoE has a shared expert in every layer; set shared_expert_size.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Qwen3.5 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    if cfg.architecture == "qwen3_next":
        common = {**common, "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
                  "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.layer_is_moe(i)]}
    elif cfg.num_experts:
        common = {k: v for k, v in common.items() if k != "intermediate_size"}
    if cfg.num_experts:
        common.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                      moe_intermediate_size=cfg.expert_size, shared_expert_intermediate_size=cfg.shared_expert_size)
    m = cfg.linear or LinearAttention(*(_DEFAULTS[f"linear_{k}"] for k in (
        "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel_dim")))
    types = [("linear_attention" if cfg.layer_is_linear(i) else "full_attention") for i in range(cfg.num_layers)]
    return hf_dict(common, layer_types=types, attention_bias=False, linear_num_key_heads=m.key_heads,
                   linear_num_value_heads=m.value_heads, linear_key_head_dim=m.key_dim,
                   linear_value_head_dim=m.value_dim, linear_conv_kernel_dim=m.conv_kernel,
                   rope_parameters={**common["rope_parameters"], "partial_rotary_factor": cfg.rope_dim / cfg.head_dim})
