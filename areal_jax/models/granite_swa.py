"""Granite SWA and Granite MoE SWA (`GraniteSWAForCausalLM`, `GraniteMoeSWAForCausalLM`): what their config.json
means here beyond Granite's and Granite MoE Shared's (their `base_families` rows read the rest).

Granite's layer (its four scalars: embeddings, residual branches and logits scaled, attention scaled by
attention_multiplier), with:
- sliding-window attention in the layers `layer_types` names (by default every layer but each fourth, from the
  first: layers 0, 4, 8, ... attend over everything), window `sliding_window` (128 by default);
- a learned sink logit per query head in every layer (self_attn.sinks: the softmax's output scaled by
  sigmoid(logsumexp(scores) - sink), which is a softmax with one more key of logit `sink` and value zero: gpt-oss'
  sinks, `ModelConfig.attention_sinks`);
- a RoPE base per layer (`layer_rope_theta`, 0 for a layer without rotary embeddings), read here as one base for the
  full-attention layers (`rope_theta`), one for the sliding layers (`rope_local_theta` where it differs) and the
  layers without (`rope_layers`); any other assignment is refused.
Granite MoE SWA has Granite MoE Shared's experts (stacked, an ungated shared MLP where shared_intermediate_size is set),
named block_sparse_moe.router, block_sparse_moe.experts.gate_up_proj and .down_proj on disk (`moe_hf_name`).
"""
from __future__ import annotations

from typing import Any

from areal_jax.models.hf_family import rename

DEFAULT_WINDOW = 128  # transformers' GraniteSWAConfig / GraniteMoeSWAConfig sliding_window
# Granite MoE SWA's checkpoints name the stacked experts as transformers' fused-experts modules do
_MOE_NAMES = ((".block_sparse_moe.router.layer.", ".block_sparse_moe.router."),
              (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
              (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"))


def moe_hf_name(name: str) -> str:
    """Granite MoE SWA's name of a tensor the weight table names as Granite MoE's (the same layouts: the experts'
    gate and up rows stacked [E, 2F, D], their down [E, D, F])."""
    return rename(name, _MOE_NAMES)


def layer_thetas(d: dict, types: tuple[str, ...], theta: float,
                 scaled: bool) -> tuple[float, float | None, tuple[int, ...] | None]:
    """(rope_theta, rope_local_theta, rope_layers) of a config.json's layer_rope_theta (its absence: `theta` in every
    layer) and each layer's attention kind `types`; `scaled`: the file's RoPE has a scaling, which transformers
    applies to every base (here the sliding layers' own base takes none, so the two together are refused)."""
    thetas = d.get("layer_rope_theta")
    if thetas is None:
        return theta, None, None
    if len(thetas) != len(types):
        raise ValueError(f"layer_rope_theta has {len(thetas)} entries; num_hidden_layers={len(types)} needs one per "
                         "layer (0 for a layer without rotary embeddings).")
    full = sorted({float(t) for t, k in zip(thetas, types) if t and k == "full_attention"})
    local = sorted({float(t) for t, k in zip(thetas, types) if t and k == "sliding_attention"})
    if len(full) > 1 or len(local) > 1:
        raise ValueError(f"layer_rope_theta={list(thetas)}: here the full-attention layers share one RoPE base and the "
                         f"sliding ones another (or 0: none); this file gives the full ones {full}, the sliding ones "
                         f"{local}.")
    base = (full or local or [theta])[0]
    own = local[0] if local and local[0] != base else None
    if own is not None and scaled:
        raise ValueError(f"layer_rope_theta gives the sliding layers their own base ({own}) with a RoPE scaling, "
                         "which transformers applies to both bases; here a sliding layer's own base takes no scaling. "
                         "Not supported: use one base, or the default RoPE.")
    flags = tuple(int(bool(t)) for t in thetas)
    return base, own, None if all(flags) else flags


def hf_keys(cfg: Any, types: list[str]) -> dict:
    """Their own config.json keys: the window, each layer's kind and its RoPE base (0: none)."""
    bases = {"none": 0, "local": cfg.rope_local_theta, "global": cfg.rope_theta}
    return dict(sliding_window=cfg.sliding_window, layer_types=types,
                layer_rope_theta=[bases[cfg.layer_rope(i)] for i in range(cfg.num_layers)])


def check_hf(cfg: Any, hf_class: str) -> None:
    """Refuses what their classes would not load as it is (the rest is their rows' `base_families.check_hf`)."""
    if not cfg.attention_sinks:
        raise ValueError(f"HF {hf_class} has a sink logit per head in every layer; set attention_sinks=True.")
    if cfg.rope_local_theta is not None and cfg.rope_scaling is not None:
        raise ValueError(f"HF {hf_class} scales every layer's RoPE base alike; set rope_local_theta=None or "
                         "rope_scaling=None.")
