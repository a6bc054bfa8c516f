"""MiniMax-M2 (`MiniMaxM2ForCausalLM`: MiniMax-M2, M2.1, M2.5): what its config.json means here (`hf_fields`,
`hf_dict`, `check_hf`).

The layer as transformers runs it: grouped-query attention without biases, q/k RMSNorm over the whole projection
(all heads together, as OLMo's), RoPE on the first `rotary_dim` dimensions of each head (the released configs give
`rotary_dim`; transformers reads it as partial_rotary_factor = rotary_dim / head_dim); then a mixture of experts in
every layer, Mixtral's layout on disk (block_sparse_moe.gate, block_sparse_moe.experts.{j}.w1 / w3 / w2, experts of
intermediate_size) with DeepSeek-V3's router without groups or shared experts: sigmoid scores, the picking bias
block_sparse_moe.e_score_correction_bias added to pick the top num_experts_per_tok, their scores renormalised as the
weights. Multi-token-prediction modules (use_mtp) are not read.
"""
from __future__ import annotations

from typing import Any

_DEFAULTS = dict(num_local_experts=256, num_experts_per_tok=8, rope_theta=5_000_000.0)


def hf_fields(d: dict) -> dict:
    """The ModelConfig fields a MiniMax-M2 config.json sets beyond the common ones (transformers' defaults where a
    key is absent); refuses routing transformers would not run as the config says."""
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func={d['scoring_func']!r}: transformers' MiniMaxM2 scores experts with a sigmoid; "
                         "this checkpoint is another model.")
    if float(d.get("routed_scaling_factor", 1.0) or 1.0) != 1.0:
        raise ValueError(f"routed_scaling_factor={d['routed_scaling_factor']}: transformers' MiniMaxM2 weighs the "
                         "experts by their renormalised scores alone, so this checkpoint would run differently there.")
    if d.get("shared_intermediate_size"):
        raise ValueError(f"shared_intermediate_size={d['shared_intermediate_size']}: transformers' MiniMaxM2 has no "
                         "shared expert.")
    return dict(num_experts=int(d.get("num_local_experts", _DEFAULTS["num_local_experts"])),
                num_experts_per_tok=int(d.get("num_experts_per_tok", _DEFAULTS["num_experts_per_tok"])),
                norm_topk_prob=True, router_scoring="sigmoid", router_score_bias=True)


def partial_factor(d: dict, head_dim: int) -> float | None:
    """MiniMax-M2's share of each head that rotates, from its legacy `rotary_dim` (None when absent)."""
    return None if d.get("rotary_dim") is None else int(d["rotary_dim"]) / head_dim


def check_hf(cfg: Any) -> None:
    """Refuses a MiniMax-M2 config that transformers' class would not load as it is; the error names the fields."""
    if cfg.architecture != "minimax_m2":
        return
    if cfg.attention_bias or not cfg.qk_norm or cfg.moe_layers is not None or cfg.expert_size != cfg.intermediate_size:
        raise ValueError("HF MiniMaxM2 has q/k norm, no q/k/v bias and experts of intermediate_size in every layer; "
                         "set qk_norm=True, attention_bias=False, moe_layers=None, moe_intermediate_size=None.")
    if cfg.router_scoring != "sigmoid" or not cfg.router_score_bias or cfg.router_groups is not None \
            or cfg.routed_scaling_factor != 1.0 or not cfg.norm_topk_prob or cfg.shared_expert_size is not None:
        raise ValueError("HF MiniMaxM2 routes by sigmoid scores with a picking bias, no groups, renormalised weights, "
                         "no scaling factor and no shared expert; set router_scoring='sigmoid', router_score_bias=True, "
                         "router_groups=None, routed_scaling_factor=1.0, norm_topk_prob=True, shared_expert_size=None.")


def hf_dict(cfg: Any) -> dict:
    """MiniMax-M2's own config.json keys (beside hf_config's common ones and `glm4.partial_rotary_keys`)."""
    return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                rotary_dim=cfg.rope_dim, scoring_func="sigmoid", use_routing_bias=True, output_router_logits=False,
                router_jitter_noise=0.0, pad_token_id=None, attention_bias=False)
