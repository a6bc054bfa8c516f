"""Parameter counts of a ModelConfig from its shapes alone (no model built): `ModelConfig.num_params` and
`ModelConfig.matmul_params_per_token` call these."""
from __future__ import annotations

from typing import Any

from areal_jax.models.mixers import kind


def latent_attention_weights(cfg: Any) -> int:
    """The projections' weights of one latent-attention layer (models.mla), norms aside."""
    m, d, h = cfg.mla, cfg.hidden_size, cfg.num_heads
    q = d * h * (m.nope + m.rope) if m.q_lora_rank is None else m.q_lora_rank * (d + h * (m.nope + m.rope))
    return q + d * (m.kv_lora_rank + m.rope) + m.kv_lora_rank * h * (m.nope + m.v) + h * m.v * d


def linear_attention_weights(cfg: Any) -> tuple[int, int]:
    """(matrices, the rest) of one stateful layer (`mixers`' weights: Gated DeltaNet's, a short convolution's,
    Mamba-2's)."""
    return kind(cfg).weights(cfg)


def attention_matrices(cfg: Any, i: int) -> int:
    """The weights of layer i's token mixer one token multiplies through (Qwen3.5's q_proj gives a gate too)."""
    d, hq, hd, kv = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
    if cfg.layer_is_linear(i):
        return linear_attention_weights(cfg)[0]
    if cfg.layer_is_hybrid(i):  # attention and the mixer side by side (Falcon-H1)
        return linear_attention_weights(cfg)[0] + attention_matrices(cfg.replace(layer_types=None, mamba=None), i)
    if cfg.mla is not None:
        return latent_attention_weights(cfg)
    return d * hd * (hq * (2 if cfg.gated_attention else 1) + 2 * kv) + hq * hd * d + (d * hq if cfg.head_gate else 0)


def mlp_matrices(cfg: Any) -> int:
    """A dense MLP's (an expert's) weight matrices: gate, up and down, or up and down where it has no gate (Arcee,
    Nemotron-H)."""
    return 3 if cfg.gated_mlp else 2


def num_params(cfg: Any) -> int:
    """Total number of parameters (embedding counted once when tied)."""
    d, f, h, k, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = d * h * hd * 2 + d * k * hd * 2 + (h * hd + 2 * k * hd if cfg.attention_bias else 0)
    attn += ((h + k) * hd if cfg.flat_qk_norm else 2 * hd) if cfg.qk_norm and not cfg.weightless_norms else 0
    attn += (d if cfg.attention_out_bias else 0) + (h if cfg.attention_sinks else 0) + (d * h if cfg.head_gate else 0)
    if cfg.mla is not None:  # its projections and the latent's (and the query's) norm
        attn = latent_attention_weights(cfg) + cfg.mla.kv_lora_rank + (cfg.mla.q_lora_rank or 0)
    if cfg.gated_attention:  # q_proj's output gate
        attn += d * h * hd
    norm = 0 if cfg.weightless_norms else d * (2 if cfg.norm_bias else 1)  # a LayerNorm's bias besides its scale
    one = cfg.parallel_block and not cfg.parallel_mlp_norm  # (Cohere's parallel block: one norm)
    layer = attn + (4 if cfg.sandwich_norms else 1 if one else 2) * norm
    linear = sum(cfg.layer_is_linear(i) for i in range(cfg.num_layers))
    stateful = linear + sum(cfg.layer_is_hybrid(i) for i in range(cfg.num_layers))  # (hybrid: attention's too)
    mixers = (cfg.num_layers - linear) * attn + (stateful * sum(linear_attention_weights(cfg)) if stateful else 0)
    m = mlp_matrices(cfg)  # an expert's and a shared expert's matrices too
    shared = m * d * cfg.shared_expert_size + d * cfg.shared_expert_gated if cfg.shared_expert_size else 0
    biases = cfg.num_experts * (2 * cfg.expert_size + d + 1) if cfg.expert_bias else 0  # gate, up, down; router
    biases += cfg.num_experts if cfg.router_score_bias else 0
    mlp_biases = (mlp_matrices(cfg) - 1) * f + d if cfg.mlp_bias else 0  # (StarCoder2's c_fc and c_proj biases)
    mlp_biases += 2 if cfg.mlp_activation == "xielu" else 0  # (Apertus' alpha_p, alpha_n; beta, eps: buffers)
    ffn = sum(cfg.num_experts * m * d * cfg.expert_size + d * cfg.num_experts + shared + biases if cfg.layer_is_moe(i)
              else mlp_matrices(cfg) * d * f + mlp_biases if cfg.layer_has_mlp(i) else -norm  # (no MLP: nor its norm)
              for i in range(cfg.num_layers))
    emb = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    return mixers + cfg.num_layers * (layer - attn) + ffn + emb + norm + (cfg.vocab_size if cfg.lm_head_bias else 0)


def matmul_params_per_token(cfg: Any) -> int:
    """The weights one token multiplies through in the decoder layers (the unembedding aside): every attention
    projection, and its layer's MLP, or its top-k experts, the router and any shared expert. 2x this is a token's
    forward matmul FLOPs there (the active parameters of a mixture of experts)."""
    d = cfg.hidden_size
    m = mlp_matrices(cfg)
    moe = cfg.num_experts_per_tok * m * d * cfg.expert_size + d * cfg.num_experts
    moe += m * d * cfg.shared_expert_size + d * cfg.shared_expert_gated if cfg.shared_expert_size else 0
    dense = m * d * cfg.intermediate_size
    return sum(attention_matrices(cfg, i) + (moe if cfg.layer_is_moe(i) else dense if cfg.layer_has_mlp(i) else 0)
               for i in range(cfg.num_layers))
