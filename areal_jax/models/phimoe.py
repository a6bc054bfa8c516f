"""PhiMoE (`PhimoeForCausalLM`: Phi-3.5-MoE-instruct, Phi-mini-MoE-instruct, Phi-tiny-MoE-instruct): what its
config.json means here (`config_from_hf`, `config_to_hf`, `check_hf`).

Mixtral's layer (its experts on disk as block_sparse_moe.experts.{j}.w1 / w2 / w3, of intermediate_size, in every
layer) with LayerNorms (a scale and a bias; `ModelConfig.layer_norm`) in place of RMSNorms, biases on q/k/v/o
(`attention_bias`) and on the output logits (`lm_head_bias`), and the sparsemixer router (`routing.sparsemixer`:
transformers' eval-mode routing, which picks the two largest logits one after another and weighs each by a softmax
over the logits within a relative margin of it; its weights are not renormalised). transformers' training mode
instead samples the picks (Gumbel noise) and estimates their gradient, and multiplies the router's input by noise
(input_jitter_noise): an RL run routes as the sampler did, deterministically, in both its sampler and its trainer,
and the router's gradient is that of the weights above. With LongRoPE, cos and sin are scaled by the file's
short_mscale / long_mscale (the one of the run's length: `ModelConfig.for_sequence_length`).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import common_fields, hf_dict, require_fields
from areal_jax.models.tensor_layout import block_sparse_moe

HF_CLASSES = {"phimoe": "PhimoeForCausalLM"}
_DEFAULTS = dict(vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, num_local_experts=16,
                 num_experts_per_tok=2, router_jitter_noise=0.01)  # transformers' PhimoeConfig, where a key is absent
_MSCALES = ("short_mscale", "long_mscale")


def hf_name(name: str, cfg: Any = None) -> str:
    """PhiMoE's name of a tensor the weight table names as Qwen3-MoE's: Mixtral's (`tensor_layout.block_sparse_moe`)."""
    return block_sparse_moe(name)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a PhiMoE config.json (transformers' defaults where a key is absent)."""
    fields, get = common_fields(d, model_type, _DEFAULTS, "PhiMoE")
    if "rope_theta" not in d and "rope_theta" not in (d.get("rope_parameters") or {}):
        fields["rope_theta"] = 1e6  # PhimoeConfig's default base
    scaling = fields["rope_scaling"]
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "longrope":
            raise ValueError(f"PhiMoE's rope type {kind!r} is not supported here; its checkpoints use 'longrope' "
                             "(or none).")
        missing = [k for k in _MSCALES if not isinstance(scaling.get(k), (int, float))]
        if missing:
            raise ValueError(f"PhiMoE's LongRoPE needs numbers {' and '.join(missing)} in rope_scaling (transformers "
                             "refuses the file without them).")
        scaling.setdefault("original_max_position_embeddings", get("original_max_position_embeddings") or 4096)
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias: PhiMoE's experts have no biases.")
    k = int(get("num_experts_per_tok"))
    if k != 2:
        raise ValueError(f"num_experts_per_tok={k}: transformers' PhiMoE router (sparsemixer) always picks 2 experts, "
                         "whatever this key says; a checkpoint trained with another count is not PhiMoE's.")
    window = get("sliding_window")
    bias = bool(get("attention_bias"))
    return cls(**fields, sliding_window=int(window) if window and int(window) < fields["max_position_embeddings"]
               else None, attention_bias=bias, attention_out_bias=bias, lm_head_bias=bool(get("lm_head_bias")),
               num_experts=int(get("num_local_experts")), num_experts_per_tok=k, norm_topk_prob=False,
               router_scoring="sparsemixer", router_jitter=float(get("router_jitter_noise")), dtype=dtype,
               param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' PhimoeForCausalLM would not load as it is (and PhiMoE's router or output bias
    in another family, which has neither)."""
    if cfg.architecture not in HF_CLASSES:
        used = [k for k, on in (("lm_head_bias", cfg.lm_head_bias and cfg.architecture != "phi"),
                                ("router_scoring='sparsemixer'", cfg.router_scoring == "sparsemixer")) if on]
        if used:
            raise ValueError(f"{', '.join(used)}: PhiMoE's; HF {cfg.architecture} has none. Turn it off or use "
                             "architecture='phimoe'.")
        return
    require_fields(cfg, "PhiMoE", "Mixtral's layer (every layer slides or none) with biases on q/k/v/o together, no "
                   "q/k norm, full-width RoPE, two experts of intermediate_size in every layer picked by sparsemixer",
                   attention_out_bias=cfg.attention_bias, qk_norm=False, rotary_dim=None, layer_types=None,
                   rope_layers=None, moe_layers=None, moe_intermediate_size=None, shared_expert_size=None,
                   router_scoring="sparsemixer", num_experts_per_tok=2, norm_topk_prob=False, routed_scaling_factor=1.0,
                   expert_bias=False)
    s = cfg.rope_scaling
    if s is not None and (s["rope_type"] != "longrope" or any(k not in s for k in _MSCALES)):
        raise ValueError("HF PhiMoE takes LongRoPE with short_mscale and long_mscale (or no scaling); set "
                         "rope_scaling so.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a PhiMoE config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    return hf_dict(common, hidden_act="silu", attention_bias=cfg.attention_bias, lm_head_bias=cfg.lm_head_bias,
                   sliding_window=cfg.sliding_window, num_local_experts=cfg.num_experts, num_experts_per_tok=2,
                   router_jitter_noise=cfg.router_jitter, input_jitter_noise=0.0, output_router_logits=False,
                   pad_token_id=None)
