"""Granite 4.0 (`GraniteMoeHybridForCausalLM`): attention-only (granite-4.0-micro) or hybrid with Mamba-2 layers
(`models.mamba2`), dense or with experts (granite-4.0-h-tiny / -h-small): what their config.json means here
(`config_from_hf`, `config_to_hf`, `check_hf`).

Granite 3's layer (its four scalars: the embeddings times embedding_multiplier, each branch's output times
residual_multiplier, attention scores times attention_multiplier, logits divided by logits_scaling) whose MLP is the
"shared MLP": gate and up rows fused in shared_mlp.input_linear [2F, D], shared_mlp.output_linear [D, F], of width
shared_intermediate_size. layer_types says which layers mix tokens by attention and which by a Mamba-2 mixer
(mamba_n_heads heads of mamba_d_head, or mamba_expand x hidden_size / heads; mamba_n_groups groups of B and C of
mamba_d_state; mamba_d_conv taps with a bias; one in_proj giving z, x B C and dt). RoPE only where
position_embedding_type is "rope" (none otherwise, as transformers' class). With experts (num_local_experts > 0:
granite-4.0-h-tiny / -h-small) the feed-forward is Granite 3 MoE's experts (block_sparse_moe: the top-k router
logits' softmax, experts of intermediate_size) plus the shared MLP, ungated.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.hf_family import hf_dict, reader, rename
from areal_jax.models.mamba2 import hf_keys, shapes_from_hf
from areal_jax.models.tensor_layout import Layout

HF_CLASSES = {"granitemoehybrid": "GraniteMoeHybridForCausalLM"}
LAYOUTS = {"granitemoehybrid": Layout(gate_up="fused", experts="stacked")}  # (Granite MoE's experts and shared MLP)
_NAMES = ((".mlp.gate_up_proj.", ".shared_mlp.input_linear."), (".mlp.down_proj.", ".shared_mlp.output_linear."))
_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=1024,
                 rope_theta=10000.0)  # transformers' GraniteMoeHybridConfig, where a config.json leaves a key out
SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
_ATTENTION, _MAMBA = ("attention", "full_attention"), ("mamba", "linear_attention")
def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an attention-only Granite 4.0 config.json (transformers' defaults where a key is absent)."""
    get = reader(d, _DEFAULTS, none_is_default=True)

    layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
    types = list(d.get("layer_types") or d.get("layers_block_type") or ["mamba"] * layers)
    if len(types) != layers or any(t not in _ATTENTION + _MAMBA for t in types):
        raise ValueError(f"Granite 4.0's layer_types hold num_hidden_layers={layers} entries, each attention or mamba; "
                         f"got {types}.")
    types = ["full_attention" if t in _ATTENTION else "linear_attention" for t in types]
    mamba = shapes_from_hf(d, int(get("hidden_size"))) if "linear_attention" in types else None
    if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias"):
        raise ValueError("Granite 4.0 here has SiLU MLPs and no attention biases; this config.json says "
                         f"hidden_act={d.get('hidden_act')!r}, attention_bias={d.get('attention_bias')!r}.")
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Granite 4.0's rope_parameters {rope}: only the default RoPE is supported here.")
    width, eos, experts = int(get("shared_intermediate_size")), get("eos_token_id"), int(get("num_local_experts") or 0)
    moe = dict(num_experts=experts, num_experts_per_tok=int(get("num_experts_per_tok")), norm_topk_prob=True,
               moe_intermediate_size=int(d.get("intermediate_size") or 11008), shared_expert_size=width,
               shared_expert_gated=False) if experts else {}
    return cls(architecture=model_type, vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
               intermediate_size=width, num_layers=layers, num_heads=heads,
               num_kv_heads=int(d.get("num_key_value_heads") or heads), head_dim=int(get("hidden_size")) // heads,
               rope_theta=float(rope.get("rope_theta", d.get("rope_theta") or _DEFAULTS["rope_theta"])),
               rope_layers=None if d.get("position_embedding_type") == "rope" else (0,) * layers,
               rms_norm_eps=float(get("rms_norm_eps")), tie_word_embeddings=bool(get("tie_word_embeddings")),
               max_position_embeddings=int(get("max_position_embeddings")), bos_token_id=get("bos_token_id"),
               eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
               layer_types=None if mamba is None else tuple(types), mamba=mamba,
               **{k: float(d.get(k, 1.0)) for k in SCALARS}, **moe, dtype=dtype, param_dtype=param_dtype)


def hf_name(name: str, cfg: Any = None) -> str:
    """Granite 4.0's name of a tensor the weight table names as Llama's: a layer without experts has its MLP as the
    others' shared one (shared_mlp.input_linear, gate and up fused; shared_mlp.output_linear)."""
    return rename(name, _NAMES)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' GraniteMoeHybridForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    bad = [k for k, v in dict(attention_bias=cfg.attention_bias, qk_norm=cfg.qk_norm, sliding_window=cfg.sliding_window,
                              rotary_dim=cfg.rotary_dim, rope_scaling=cfg.rope_scaling, linear=cfg.linear,
                              short_conv=cfg.short_conv, moe_layers=cfg.moe_layers).items() if v]
    if cfg.rope_layers is not None and any(cfg.rope_layers):
        bad.append("rope_layers (every layer rotates or none)")
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        bad.append("head_dim (hidden_size / num_heads)")
    if cfg.num_experts and (cfg.shared_expert_gated or cfg.shared_expert_size != cfg.intermediate_size
                            or not cfg.norm_topk_prob):
        bad.append("experts other than Granite's (renormalised top-k) beside an ungated shared MLP of intermediate_size")
    if cfg.mamba is not None and cfg.mamba.heads * cfg.mamba.head_dim % cfg.hidden_size:
        bad.append("mamba heads x head_dim other than a multiple of hidden_size (mamba_expand)")
    if bad:
        raise ValueError(f"HF Granite 4.0 (attention layers only) has none of / other: {', '.join(bad)}.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Granite 4.0 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    common = {k: v for k, v in common.items() if k not in ("head_dim", "intermediate_size")}
    mamba = {} if cfg.mamba is None else hf_keys(cfg)
    types = ["mamba" if cfg.layer_is_linear(i) else "attention" for i in range(cfg.num_layers)]
    experts = dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   intermediate_size=cfg.expert_size) if cfg.num_experts else dict(num_local_experts=0)
    return hf_dict(common, **mamba, layer_types=types, shared_intermediate_size=cfg.intermediate_size,
                   position_embedding_type="nope" if cfg.rope_layers is not None else "rope", attention_bias=False,
                   **{k: getattr(cfg, k) or 1.0 for k in SCALARS}, **experts, output_router_logits=False)
