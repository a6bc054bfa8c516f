"""Jamba (`JambaForCausalLM`: AI21-Jamba-Reasoning-3B, Jamba Mini / Large): what its config.json means here
(`config_from_hf`, `config_to_hf`, `check_hf`) and its tensors' names (`hf_name`).

Llama's pre-norm layer whose token mixer is, in most layers, a Mamba mixer (`models.mamba1`: mamba_expand x
hidden_size channels of mamba_d_state states, a time step of rank mamba_dt_rank, mamba_d_conv taps; its time step's
input, B and C RMS-normalised) and attention in every attn_layer_period-th layer from attn_layer_offset, with no
position embeddings at all. The feed-forward is a SwiGLU MLP, or in every expert_layer_period-th layer from
expert_layer_offset (where num_experts > 1) num_experts experts of intermediate_size, each token sent to its top
num_experts_per_tok by the softmax of the router's logits, those weights kept as they are. Names as Bamba's
(feed_forward, pre_ff_layernorm, mamba, final_layernorm); the router is feed_forward.router.
"""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from areal_jax.models import bamba
from areal_jax.models.hf_family import common_fields, hf_dict, require_fields
from areal_jax.models.mixer_checks import Mamba1

HF_CLASSES = {"jamba": "JambaForCausalLM"}
_DEFAULTS = dict(vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=262144, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2, num_experts=16,
                 expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8, attn_layer_offset=4,
                 mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto", mamba_conv_bias=True,
                 mamba_proj_bias=False)  # transformers' JambaConfig


def hf_name(name: str, cfg: Any = None) -> str:
    """Jamba's name of a tensor the weight table names as Llama's and Qwen3-MoE's (`hf_names.weight_entries`)."""
    return bamba.hf_name(name).replace(".feed_forward.gate.weight", ".feed_forward.router.weight")


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Jamba config.json (transformers' defaults where a key is absent)."""
    fields, get = common_fields(d, model_type, _DEFAULTS, "Jamba")
    if not get("mamba_conv_bias") or get("mamba_proj_bias") or d.get("attention_bias"):
        raise ValueError("Jamba here has a convolution bias and no projection or attention biases "
                         "(mamba_conv_bias=true, mamba_proj_bias=false), as the released checkpoints have.")
    layers, hidden = fields["num_layers"], fields["hidden_size"]
    periods = {k: int(get(k)) for k in ("attn_layer_period", "attn_layer_offset", "expert_layer_period",
                                        "expert_layer_offset")}
    if periods["attn_layer_offset"] >= periods["attn_layer_period"] or \
            periods["expert_layer_offset"] >= periods["expert_layer_period"]:
        raise ValueError(f"Jamba's layer offsets must be below their periods; this config.json has {periods}.")
    types = tuple("full_attention" if i % periods["attn_layer_period"] == periods["attn_layer_offset"] else
                  "linear_attention" for i in range(layers))
    rank = get("mamba_dt_rank")
    rank = math.ceil(hidden / 16) if rank == "auto" else int(rank)
    mamba = Mamba1(int(get("mamba_expand")) * hidden, int(get("mamba_d_state")), rank, int(get("mamba_d_conv")))
    experts = int(get("num_experts") or 1)
    moe = {}
    if experts > 1:
        flags = tuple(int(i % periods["expert_layer_period"] == periods["expert_layer_offset"]) for i in range(layers))
        moe = dict(num_experts=experts, num_experts_per_tok=int(get("num_experts_per_tok")), norm_topk_prob=False,
                   moe_layers=None if all(flags) else flags)
    return cls(**fields, rope_layers=(0,) * layers, layer_types=types if "linear_attention" in types else None,
               mamba1=mamba if "linear_attention" in types else None, **moe, dtype=dtype, param_dtype=param_dtype)


def _periods(flags: list[bool]) -> tuple[int, int] | None:
    """(period, offset) with flags[i] == (i % period == offset) for every i, the smallest such; None if none."""
    n = len(flags)
    for period in range(1, n + 1):
        for offset in range(period):
            if all(flags[i] == (i % period == offset) for i in range(n)):
                return period, offset
    return None


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' JambaForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Jamba", "Llama's attention with no position embeddings (no biases, no q/k norm, no windows) "
                   "beside Mamba mixers, and experts whose weights are not renormalised", rope_layers=(0,) * cfg.num_layers,
                   attention_bias=False, qk_norm=False, rotary_dim=None, sliding_window=None, linear=None, mamba=None,
                   shared_expert_size=None, norm_topk_prob=False)
    attention = [not cfg.layer_is_linear(i) for i in range(cfg.num_layers)]
    experts = [cfg.layer_is_moe(i) for i in range(cfg.num_layers)]
    if _periods(attention) is None or cfg.num_experts and _periods(experts) is None:
        raise ValueError("HF Jamba places its attention layers (and its expert layers) every period-th layer from an "
                         f"offset; these cannot be written so: attention {attention}, experts {experts}.")
    if cfg.mamba1 is not None and (cfg.mamba1.norms != "scaled" or cfg.mamba1.norm_eps is not None
                                   or cfg.mamba1.inner % cfg.hidden_size):
        raise ValueError("HF Jamba's Mamba mixers normalise their time step's input, B and C with scales (norms="
                         f"'scaled', norm_eps None) and have mamba_expand x hidden_size channels; mamba1={cfg.mamba1} "
                         "has not.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Jamba config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    attention = _periods([not cfg.layer_is_linear(i) for i in range(cfg.num_layers)])
    if attention is None or not any(not cfg.layer_is_linear(i) for i in range(cfg.num_layers)):
        attention = (cfg.num_layers + 1, cfg.num_layers)  # (no attention layer: an offset no layer reaches)
    m = cfg.mamba1
    mamba = {} if m is None else dict(mamba_d_state=m.state, mamba_d_conv=m.conv_kernel,
                                      mamba_expand=m.inner // cfg.hidden_size, mamba_dt_rank=m.dt_rank)
    experts = dict(num_experts=1, expert_layer_period=1, expert_layer_offset=0)
    if cfg.num_experts:
        period, offset = _periods([cfg.layer_is_moe(i) for i in range(cfg.num_layers)])
        experts = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                       expert_layer_period=period, expert_layer_offset=offset)
    return hf_dict(common, **mamba, **experts, attn_layer_period=attention[0], attn_layer_offset=attention[1],
                   mamba_conv_bias=True, mamba_proj_bias=False, pad_token_id=None)
