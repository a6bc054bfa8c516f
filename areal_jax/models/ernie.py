"""ERNIE 4.5 (`Ernie4_5ForCausalLM`: ERNIE-4.5-0.3B; `Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B, -300B-A47B and
their Thinking versions): what their config.json means here (`config_from_hf`, `config_to_hf`, `check_hf`).

The layer is Llama's (grouped-query attention, no biases) with RoPE on interleaved pairs of each head
(`ModelConfig.rope_interleave`; taken apart into halves, queries and keys alike, before the rotation). In the mixture
of experts, layers i with moe_layer_start_index <= i <= moe_layer_end_index and (i + 1) % moe_layer_interval == 0 have
`moe_num_experts` experts of moe_intermediate_size plus `moe_num_shared_experts` shared ones (one ungated MLP); the
others a dense MLP. The router: a float32 softmax over the experts, the top `moe_k` picked after adding the picking
bias (mlp.moe_statics.e_score_correction_bias, [1, E] on disk), their probabilities renormalised as the weights
(transformers clamps the sum below at moe_norm_min, 1e-12: no difference for a sum of top-k probabilities). The
multi-token-prediction layers are not read; `use_bias` checkpoints (biases on every projection) are refused.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import reader, rope_of
from areal_jax.models.tensor_layout import Layout

HF_CLASSES = {"ernie4_5": "Ernie4_5ForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM"}
LAYOUTS = {"ernie4_5_moe": Layout(score_bias="statics")}  # its picking bias in moe_statics
_DEFAULTS = {  # transformers' config defaults, where a config.json leaves a key out
    "ernie4_5": dict(vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
                     num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                     tie_word_embeddings=True),
    "ernie4_5_moe": dict(vocab_size=103424, hidden_size=2560, intermediate_size=12288, num_hidden_layers=28,
                         num_attention_heads=20, num_key_value_heads=4, head_dim=None, max_position_embeddings=131072,
                         tie_word_embeddings=True, moe_intermediate_size=1536, moe_num_experts=64, moe_k=6,
                         moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=None,
                         moe_layer_interval=1, moe_norm_min=1e-12)}


def _moe_flags(get: Any, layers: int) -> tuple[int, ...] | None:
    start, interval = int(get("moe_layer_start_index")), int(get("moe_layer_interval"))
    end = get("moe_layer_end_index")
    end = layers - 1 if end is None or int(end) < 0 else int(end)
    flags = tuple(int(start <= i <= end and (i + 1) % interval == 0) for i in range(layers))
    return None if all(flags) else flags


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an ERNIE 4.5 config.json (transformers' defaults where a key is absent)."""

    defaults = _DEFAULTS[model_type]

    get = reader(d, defaults)

    if d.get("use_bias"):
        raise ValueError("use_bias=True (biases on every projection) is not supported for ERNIE 4.5; its released "
                         "checkpoints have none.")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not ERNIE 4.5's ('silu').")
    rope, _ = rope_of(d)
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 500000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    heads, layers = int(get("num_attention_heads")), int(get("num_hidden_layers"))
    experts: dict = {}
    if model_type == "ernie4_5_moe":
        if float(get("moe_norm_min")) > 1e-6:
            raise ValueError(f"moe_norm_min={get('moe_norm_min')}: the routing weights' sum is clamped at it in "
                             "transformers, which this project does not do beyond 1e-6.")
        width, shared = int(get("moe_intermediate_size")), int(get("moe_num_shared_experts") or 0)
        experts = dict(num_experts=int(get("moe_num_experts")), num_experts_per_tok=int(get("moe_k")),
                       moe_intermediate_size=width, norm_topk_prob=True, router_score_bias=True,
                       shared_expert_size=width * shared or None, shared_expert_gated=False,
                       moe_layers=_moe_flags(get, layers))
    eos = get("eos_token_id") if "eos_token_id" in d else 2
    return cls(
        architecture=model_type, vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")), num_layers=layers, num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or int(get("hidden_size")) // heads), rope_theta=theta,
        rope_scaling=None if rope_type == "default" else rope, rope_interleave=True,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)), tie_word_embeddings=bool(get("tie_word_embeddings")),
        max_position_embeddings=int(get("max_position_embeddings")), bos_token_id=d.get("bos_token_id", 1),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos, dtype=dtype, param_dtype=param_dtype, **experts)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' ERNIE 4.5 classes would not load as it is (and rope_interleave elsewhere)."""
    arch = cfg.architecture
    if arch not in HF_CLASSES:
        if cfg.rope_interleave and arch not in ("glm4", "glm", "cohere", "cohere2", "helium"):
            raise ValueError(f"rope_interleave (RoPE on interleaved pairs) is ERNIE 4.5's, GLM's, Cohere's and Helium's; HF {arch} rotates "
                             "halves.")
        return
    if not cfg.rope_interleave or cfg.attention_bias or cfg.qk_norm or cfg.rotary_dim is not None \
            or cfg.sliding_window is not None:
        raise ValueError(f"HF {arch} rotates interleaved pairs of every dimension and has no q/k/v bias, q/k norm or "
                         "sliding window; set rope_interleave=True, attention_bias=False, qk_norm=False, "
                         "rotary_dim=None, sliding_window=None.")
    if arch == "ernie4_5_moe" and (cfg.router_scoring != "softmax" or not cfg.router_score_bias or not cfg.norm_topk_prob
                                   or cfg.router_groups is not None or cfg.routed_scaling_factor != 1.0
                                   or cfg.shared_expert_gated):
        raise ValueError("HF ERNIE 4.5 MoE picks by softmax probabilities plus a bias, renormalises them, without "
                         "groups or a scaling factor, and its shared experts are ungated; set router_scoring='softmax',"
                         " router_score_bias=True, norm_topk_prob=True, router_groups=None, routed_scaling_factor=1.0,"
                         " shared_expert_gated=False.")
    if arch == "ernie4_5_moe" and cfg.shared_expert_size is not None and cfg.shared_expert_size % cfg.expert_size:
        raise ValueError(f"HF ERNIE 4.5 MoE's shared experts are moe_num_shared_experts x moe_intermediate_size wide; "
                         f"shared_expert_size={cfg.shared_expert_size} is not a multiple of {cfg.expert_size}.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an ERNIE 4.5 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    d = {k: v for k, v in common.items() if k not in ("layer_types", "sliding_window", "rope_scaling")}
    d.update(use_bias=False, pad_token_id=None)
    if cfg.architecture == "ernie4_5_moe":
        moe = [cfg.layer_is_moe(i) for i in range(cfg.num_layers)]
        first = moe.index(True) if True in moe else cfg.num_layers
        last = cfg.num_layers - 1 - moe[::-1].index(True) if True in moe else -1
        intervals = [i for i in range(1, cfg.num_layers + 1)
                     if [bool(first <= j <= last and (j + 1) % i == 0) for j in range(cfg.num_layers)] == moe]
        if not intervals:
            raise ValueError(f"HF ERNIE 4.5 MoE places experts in the layers between a start and an end index, every "
                             f"moe_layer_interval-th; moe_layers={cfg.moe_layers} is no such pattern.")
        d.update(moe_num_experts=cfg.num_experts, moe_k=cfg.num_experts_per_tok, moe_intermediate_size=cfg.expert_size,
                 moe_num_shared_experts=(cfg.shared_expert_size or 0) // cfg.expert_size, moe_layer_start_index=first,
                 moe_layer_end_index=last, moe_layer_interval=intervals[0], moe_norm_min=1e-12,
                 output_router_logits=False, num_nextn_predict_layers=0)
    return d
