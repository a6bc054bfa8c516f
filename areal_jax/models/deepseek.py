"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: DeepSeek-V3, DeepSeek-R1, Kimi-K2, Moonlight): what its config.json means
here (`config_from_hf` / `config_to_hf`).

The layer: multi-head latent attention (`models.mla`); the first `first_k_dense_replace` layers with a dense MLP of
intermediate_size, the rest a mixture of experts of moe_intermediate_size whose router scores each expert with a
sigmoid, adds `e_score_correction_bias` to pick (not to weigh), keeps the best `topk_group` of `n_group` groups
(each ranked by its two best scores), picks the top `num_experts_per_tok` there, renormalises their scores
(`norm_topk_prob`) and multiplies them by `routed_scaling_factor`; beside them `n_shared_experts` shared experts, one
MLP of n_shared_experts x moe_intermediate_size, ungated. transformers' class runs exactly that whatever the
config's `topk_method` / `scoring_func` say, so a config naming other ones (DeepSeek-V2's) is refused. On disk the
experts are one tensor per expert (mlp.experts.{j}.gate_proj ...), the router mlp.gate.weight and
mlp.gate.e_score_correction_bias, the shared experts mlp.shared_experts.*; layers past num_hidden_layers (the
multi-token-prediction module) are not read.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.config_checks import MLA

HF_CLASS = "DeepseekV3ForCausalLM"


def config_from_hf(cls: type, d: dict, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a DeepSeek-V3 config.json (transformers' DeepseekV3Config defaults where a key is absent)."""
    from areal_jax.models.hf_config import _hf_rope  # noqa: PLC0415 (hf_config dispatches here)

    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("hidden_act", "silu"),
                        ("moe_layer_freq", 1)):
        if d.get(key, wanted) != wanted:
            raise ValueError(f"{key}={d[key]!r} is not DeepSeek-V3's ({wanted!r}), which transformers' "
                             f"{HF_CLASS} (and this project) runs; this checkpoint is another model.")
    if d.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for deepseek_v3 (its released checkpoints have none).")
    layers, heads = int(d.get("num_hidden_layers", 61)), int(d.get("num_attention_heads", 128))
    mla = MLA(None if d.get("q_lora_rank", 1536) is None else int(d.get("q_lora_rank", 1536)),
              int(d.get("kv_lora_rank", 512)), int(d.get("qk_nope_head_dim", 128)), int(d.get("qk_rope_head_dim", 64)),
              int(d.get("v_head_dim", 128)), bool(d.get("rope_interleave", True)))
    experts, shared = int(d.get("n_routed_experts", 256)), int(d.get("n_shared_experts", 1) or 0)
    width, dense = int(d.get("moe_intermediate_size", 2048)), int(d.get("first_k_dense_replace", 3) or 0)
    groups = (int(d.get("n_group", 8) or 1), int(d.get("topk_group", 4) or 1))
    rope, _ = _hf_rope(d, "deepseek_v3")
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    eos = d.get("eos_token_id", 1)
    return cls(
        architecture="deepseek_v3", vocab_size=int(d.get("vocab_size", 129280)),
        hidden_size=int(d.get("hidden_size", 7168)), intermediate_size=int(d.get("intermediate_size", 18432)),
        num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=mla.nope + mla.rope, rope_theta=theta,
        rope_scaling=None if rope_type == "default" else rope, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)), bos_token_id=d.get("bos_token_id", 0),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos, num_experts=experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 8)), moe_intermediate_size=width,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)), shared_expert_size=width * shared or None,
        shared_expert_gated=False, moe_layers=tuple(int(i >= dense) for i in range(layers)) if dense else None,
        router_scoring="sigmoid", router_groups=None if groups[0] == 1 else groups, router_score_bias=True,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 2.5)), mla=mla, dtype=dtype,
        param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config that transformers' DeepSeek-V3 (or, for DeepSeek's own fields, any other family) would not
    load as it is; the error names the fields to change."""
    own = dict(mla=cfg.mla is not None, router_scoring=cfg.router_scoring != "softmax",
               router_groups=cfg.router_groups is not None, router_score_bias=cfg.router_score_bias,
               routed_scaling_factor=cfg.routed_scaling_factor != 1.0, shared_expert_gated=not cfg.shared_expert_gated)
    if cfg.architecture != "deepseek_v3":
        used = [k for k, v in own.items() if v]
        if used:
            raise ValueError(f"{', '.join(used)} are DeepSeek-V3's; HF {cfg.architecture} has none. Leave them at "
                             "their defaults or use architecture='deepseek_v3'.")
        return
    if cfg.mla is None or cfg.router_scoring != "sigmoid" or not cfg.router_score_bias or cfg.shared_expert_gated:
        raise ValueError("HF DeepSeek-V3 has latent attention, a sigmoid router with a picking bias and ungated "
                         "shared experts; set mla, router_scoring='sigmoid', router_score_bias=True, "
                         "shared_expert_gated=False.")
    moe = [cfg.layer_is_moe(i) for i in range(cfg.num_layers)]
    first = moe.index(True) if True in moe else cfg.num_layers
    if any(moe[first:]) != all(moe[first:]) or cfg.sliding_window is not None or cfg.rope_local_theta is not None:
        raise ValueError("HF DeepSeek-V3 has dense layers first, experts in every layer after them, no sliding "
                         "window and one RoPE base; set moe_layers accordingly, sliding_window=None, "
                         "rope_local_theta=None.")
    if cfg.shared_expert_size is not None and cfg.shared_expert_size % cfg.expert_size:
        raise ValueError(f"HF DeepSeek-V3's shared experts are n_shared_experts x moe_intermediate_size wide; "
                         f"shared_expert_size={cfg.shared_expert_size} is not a multiple of {cfg.expert_size}.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a DeepSeek-V3 config: `common` (hf_config's keys every family writes) with DeepSeek's."""
    check_hf(cfg)
    m, moe = cfg.mla, [cfg.layer_is_moe(i) for i in range(cfg.num_layers)]
    groups = cfg.router_groups or (1, 1)
    d = {k: v for k, v in common.items() if k not in ("head_dim", "layer_types", "sliding_window")}
    d.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.nope,
             qk_rope_head_dim=m.rope, v_head_dim=m.v, rope_interleave=m.interleave, n_routed_experts=cfg.num_experts,
             num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.expert_size,
             n_shared_experts=(cfg.shared_expert_size or 0) // cfg.expert_size, n_group=groups[0],
             topk_group=groups[1], routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
             first_k_dense_replace=moe.index(True) if True in moe else cfg.num_layers, topk_method="noaux_tc",
             scoring_func="sigmoid", moe_layer_freq=1, attention_bias=False, num_nextn_predict_layers=0,
             pad_token_id=None)
    return d
