"""Parameter counts of a ModelConfig from its shapes alone (no model built): `ModelConfig.num_params` and
`ModelConfig.matmul_params_per_token` call these."""
from __future__ import annotations

from typing import Any


def num_params(cfg: Any) -> int:
    """Total number of parameters (embedding counted once when tied)."""
    d, f, h, k, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = d * h * hd * 2 + d * k * hd * 2 + (h * hd + 2 * k * hd if cfg.attention_bias else 0)
    attn += ((h + k) * hd if cfg.flat_qk_norm else 2 * hd) if cfg.qk_norm else 0
    attn += (d if cfg.attention_out_bias else 0) + (h if cfg.attention_sinks else 0)
    layer = attn + (4 if cfg.gemma else 2) * d
    shared = 3 * d * cfg.shared_expert_size + d if cfg.shared_expert_size else 0
    biases = cfg.num_experts * (2 * cfg.expert_size + d + 1) if cfg.expert_bias else 0  # gate, up, down; router
    ffn = sum(cfg.num_experts * 3 * d * cfg.expert_size + d * cfg.num_experts + shared + biases if cfg.layer_is_moe(i)
              else 3 * d * f for i in range(cfg.num_layers))
    emb = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * layer + ffn + emb + d


def matmul_params_per_token(cfg: Any) -> int:
    """The weights one token multiplies through in the decoder layers (the unembedding aside): every attention
    projection, and its layer's MLP, or its top-k experts, the router and any shared expert. 2x this is a token's
    forward matmul FLOPs there (the active parameters of a mixture of experts)."""
    d, hq, hd, kv = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
    attn = d * hd * (hq + 2 * kv) + hq * hd * d
    moe = cfg.num_experts_per_tok * 3 * d * cfg.expert_size + d * cfg.num_experts
    moe += 3 * d * cfg.shared_expert_size + d if cfg.shared_expert_size else 0
    return sum(attn + (moe if cfg.layer_is_moe(i) else 3 * d * cfg.intermediate_size) for i in range(cfg.num_layers))
