"""gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): what its config.json means here, its tensor names, and
its MXFP4 expert tensors, dequantised on loading.

The layer: q/k/v/o projections with biases, a learned sink logit per head in every attention softmax, every other
layer sliding (window 128), YaRN RoPE; a mixture of experts whose router has a bias (softmax over the top-k logits,
i.e. renormalised top-k probabilities), whose experts have biases on the gate, up and down products, and whose
activation is the clamped GLU (`expert_paths.glu`). On disk the experts are stacked: mlp.experts.gate_up_proj [E, D, 2F] with
gate and up interleaved along the last axis (gate at even columns), gate_up_proj_bias [E, 2F] likewise, down_proj
[E, F, D], down_proj_bias [E, D], router.weight [E, D], router.bias [E]. The released checkpoints quantise
gate_up_proj and down_proj to MXFP4: `{name}_blocks` [E, R, G, 16] uint8 (two 4-bit E2M1 values a byte, the low
nibble first) and `{name}_scales` [E, R, G] uint8 (a power-of-two exponent per 32 values, biased by 127), R the
output rows; `dequantize_mxfp4` gives the [E, G * 32, R] tensor transformers computes with. Saving writes the
unquantised tensors (no quantization_config), which transformers loads as they are.
"""
from __future__ import annotations

from typing import Any

import numpy as np

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)  # E2M1: sign, two exponent bits, one mantissa bit
MXFP4_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., G * 32, R] of MXFP4 `blocks` [..., R, G, 16] uint8 and `scales` [..., R, G] uint8: each byte's
    low nibble is the even value, its high nibble the odd one, each group of 32 values times 2 ** (scale - 127);
    the last two axes come out swapped (transformers' layout). Done one leading index at a time to bound memory."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape or blocks.ndim < 3:
        raise ValueError(f"MXFP4 tensors need blocks [..., R, G, 16] and scales [..., R, G], both uint8; got "
                         f"{blocks.dtype}{list(blocks.shape)} and {scales.dtype}{list(scales.shape)}.")
    lead, (rows, groups) = blocks.shape[:-3], blocks.shape[-3:-1]
    flat_b = blocks.reshape(-1, rows, groups, 16)
    flat_s = scales.reshape(-1, rows, groups)
    out = np.empty((flat_b.shape[0], groups * 32, rows), np.float32)
    for i in range(flat_b.shape[0]):
        b = flat_b[i]
        values = np.stack([FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]], axis=-1).reshape(rows, groups, 32)
        values = np.ldexp(values, flat_s[i].astype(np.int32)[..., None] - 127)
        out[i] = values.reshape(rows, groups * 32).T
    return out.reshape(*lead, groups * 32, rows)


def hf_fields(d: dict) -> dict:
    """The ModelConfig fields a gpt-oss config.json sets beyond the common ones (attention_bias among those, q/k/v's
    bias; transformers' GptOssConfig defaults where a key is absent)."""
    return dict(attention_out_bias=bool(d.get("attention_bias", True)), attention_sinks=True, expert_bias=True,
                num_experts=int(d.get("num_local_experts", d.get("num_experts", 128))),
                num_experts_per_tok=int(d.get("num_experts_per_tok", 4)), norm_topk_prob=True,
                swiglu_limit=float(d.get("swiglu_limit", 7.0)), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))


def check_hf(cfg: Any) -> None:
    """Refuses a config that transformers' gpt-oss (or, for the gpt-oss-only fields, any other family) would not
    load as it is: the error names the field to change."""
    own = dict(attention_sinks=cfg.attention_sinks, attention_out_bias=cfg.attention_out_bias,
               expert_bias=cfg.expert_bias, swiglu_limit=cfg.swiglu_limit is not None)
    if cfg.architecture != "gpt_oss":
        out_bias = ("seed_oss", "phimoe", "starcoder2", "gpt_neox", "phi", "jais2", "nemotron")  # (sinks: `hf_checks`)
        used = [k for k, v in own.items()
                if v and k != "attention_sinks" and not (k == "attention_out_bias" and cfg.architecture in out_bias)]
        if used:
            raise ValueError(f"{', '.join(used)} are gpt-oss's; HF {cfg.architecture} has none. Turn them off or "
                             "use architecture='gpt_oss'.")
        return
    missing = [k for k, v in own.items() if not v]
    if missing or cfg.attention_bias != cfg.attention_out_bias:
        raise ValueError(f"HF gpt-oss has attention sinks, biases on q/k/v/o (all or none), expert biases and the "
                         f"clamped GLU; set {', '.join(missing) or 'attention_bias = attention_out_bias'}.")
    if cfg.qk_norm or cfg.moe_layers is not None or not cfg.norm_topk_prob or cfg.expert_size != cfg.intermediate_size \
            or cfg.shared_expert_size is not None:
        raise ValueError("HF gpt-oss has no q/k norm and experts of intermediate_size in every layer, their weights "
                         "renormalised; set qk_norm=False, moe_layers=None, norm_topk_prob=True, "
                         "moe_intermediate_size=None, shared_expert_size=None.")
    if cfg.rope_local_theta is not None:
        raise ValueError("HF gpt-oss has one RoPE base for every layer; set rope_local_theta=None.")


def hf_dict(cfg: Any, sliding: bool, types: list[str]) -> dict:
    """The gpt-oss keys of config.json beyond the common ones (`hf_config.config_to_hf`)."""
    return dict(attention_bias=cfg.attention_bias, num_local_experts=cfg.num_experts,
                num_experts_per_tok=cfg.num_experts_per_tok, swiglu_limit=cfg.swiglu_limit,
                swiglu_alpha=cfg.swiglu_alpha, sliding_window=cfg.sliding_window if sliding else None,
                layer_types=types, router_aux_loss_coef=0.0, output_router_logits=False, pad_token_id=None)
