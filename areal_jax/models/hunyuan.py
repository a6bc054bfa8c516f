"""Hunyuan dense (`HunYuanDenseV1ForCausalLM`: Hunyuan-0.5B / 1.8B / 4B / 7B, Pretrain and Instruct) and Hunyuan MoE
(`HunYuanMoEV1ForCausalLM`: Hunyuan-A13B, Pretrain and Instruct): what their config.json means here
(`config_from_hf`, `config_to_hf`, `check_hf`).

The layer is Llama's with a per-head RMSNorm on queries and keys applied *after* RoPE (Qwen3 normalises before it;
`Attention.norm_after_rope`), named query_layernorm / key_layernorm on disk. The released checkpoints stretch the
RoPE base by a fixed NTK alpha (rope type "dynamic" with an `alpha`, which transformers computes once:
base * alpha ** (head_dim / (head_dim - 2))); that base is read here as the model's rope_theta, the same
frequencies, and written back as a plain base. Dynamic NTK scaling without an alpha and attention biases (which
would bias o_proj too) are refused.

Hunyuan MoE has that attention, and in every layer a mixture of experts as transformers' class builds it: a softmax
router (mlp.gate.wg) picks the top `moe_topk` of `num_experts` gated MLPs of intermediate_size, their weights
renormalised, and one ungated shared MLP of intermediate_size (mlp.shared_mlp) runs on every token. The released
config lists per-layer values (moe_topk, moe_intermediate_size, num_shared_expert); they are taken where every
layer has the same one that transformers' class would build (top-k the same in each layer, experts of
intermediate_size, one shared MLP), and refused otherwise, as is cross-layer attention (use_cla).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, rename, require_fields

HF_CLASSES = {"hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM", "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM"}
# its q/k norms, its router (mlp.gate.wg) and its shared expert (mlp.shared_mlp) on disk
_NAMES = ((".self_attn.q_norm.", ".self_attn.query_layernorm."), (".self_attn.k_norm.", ".self_attn.key_layernorm."),
          (".mlp.gate.weight", ".mlp.gate.wg.weight"), (".mlp.shared_experts.", ".mlp.shared_mlp."))
_DEFAULTS = dict(vocab_size=290943, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2)  # transformers' HunYuanDenseV1Config, where a config.json leaves a key out


def hf_name(name: str, cfg: Any = None) -> str:
    """Hunyuan's name of a tensor the weight table names as Qwen3's and Qwen3-MoE's (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def _one(d: dict, key: str, layers: int, default: Any) -> Any:
    """A key the released Hunyuan MoE config gives per layer (a list) or once; the one value every layer has."""
    value = d.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1 or len(value) != layers:
            raise ValueError(f"{key}={value}: transformers' HunYuanMoEV1 builds every layer alike; this config gives "
                             f"its {layers} layers different values (or another count), which is not supported.")
        value = value[0]
    return value


def _moe_fields(d: dict, layers: int, width: int) -> dict:
    """Hunyuan MoE's ModelConfig fields of its experts: as transformers' class builds them (see the docstring)."""
    if d.get("use_cla"):
        raise ValueError("use_cla=True (cross-layer attention, layers sharing keys and values) is not supported.")
    experts, topk = int(_one(d, "num_experts", layers, 1)), int(_one(d, "moe_topk", layers, 1))
    shared = int(_one(d, "num_shared_expert", layers, 1))
    moe_width = int(_one(d, "moe_intermediate_size", layers, width))
    if shared != 1 or moe_width != width:
        raise ValueError(f"num_shared_expert={shared}, moe_intermediate_size={moe_width}: transformers' "
                         f"HunYuanMoEV1 builds one shared MLP and experts, all of intermediate_size ({width}); "
                         "this checkpoint would not load there as it is.")
    if experts < 2 or not 1 <= topk <= experts:
        raise ValueError(f"num_experts={experts}, moe_topk={topk}: a mixture needs at least two experts and a top-k "
                         "among them.")
    return dict(num_experts=experts, num_experts_per_tok=topk, norm_topk_prob=True, shared_expert_size=width,
                shared_expert_gated=False)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Hunyuan dense or MoE config.json (transformers' defaults where a key is absent)."""
    fields, _ = common_fields(d, model_type, _DEFAULTS, "Hunyuan")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: biases on the projections (o_proj's too) are not supported; "
                         "the released Hunyuan dense checkpoints have none.")
    rope, head_dim = fields["rope_scaling"], fields["head_dim"]
    if rope is not None and rope.get("rope_type", rope.get("type")) == "dynamic":
        if not rope.get("alpha"):
            raise ValueError(f"rope type 'dynamic' without an 'alpha' (dynamic NTK scaling, {rope}) is not supported; "
                             "Hunyuan's checkpoints give a fixed alpha.")
        fields.update(rope_theta=fields["rope_theta"] * float(rope["alpha"]) ** (head_dim / (head_dim - 2)),
                      rope_scaling=None)
    moe = _moe_fields(d, fields["num_layers"], fields["intermediate_size"]) if model_type == "hunyuan_v1_moe" else {}
    return cls(**fields, qk_norm=True, **moe, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' HunYuanDenseV1ForCausalLM / HunYuanMoEV1ForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    family = "Hunyuan MoE" if cfg.architecture == "hunyuan_v1_moe" else "Hunyuan dense"
    require_fields(cfg, family, "q/k norm (after RoPE), no biases, and full-width RoPE in every layer without "
                   "windows", qk_norm=True, attention_bias=False, rotary_dim=None, sliding_window=None, rope_layers=None)
    if cfg.architecture == "hunyuan_v1_moe":
        require_fields(cfg, family, "experts of intermediate_size in every layer under a softmax router whose top-k "
                       "weights are renormalised, and one ungated shared MLP of intermediate_size",
                       moe_layers=None, moe_intermediate_size=None, norm_topk_prob=True, router_scoring="softmax",
                       router_score_bias=False, router_groups=None, routed_scaling_factor=1.0,
                       shared_expert_size=cfg.intermediate_size, shared_expert_gated=False)


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Hunyuan dense config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    moe = dict(num_experts=cfg.num_experts, moe_topk=cfg.num_experts_per_tok) if cfg.num_experts else {}
    return hf_dict(common, attention_bias=False, mlp_bias=False, pad_token_id=None, eod_token_id=None, **moe)
