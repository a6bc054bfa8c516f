"""Falcon-H1 (`FalconH1ForCausalLM`: Falcon-H1 0.5B to 34B, Falcon-H1R): what its config.json means here
(`config_from_hf`, `config_to_hf`, `check_hf`) and its tensors' names (`hf_name`).

Every layer is "hybrid": one pre-norm feeds attention and a Mamba-2 mixer (`models.mamba2`) side by side, their
outputs are summed into the residual stream, then a pre-normed SwiGLU MLP. Its muP multipliers (`HybridScales`):
the attention's input and output, its keys, the mixer's input and output, in_proj's five parts (ssm_multipliers: z,
x, B, C, dt), the MLP's gate before the activation and its output (mlp_multipliers), the embeddings
(embedding_multiplier) and the logits (lm_head_multiplier). The mixer's width is mamba_d_ssm (else mamba_expand x
hidden_size); its gated RMSNorm is there only with mamba_rms_norm, before or after the gate (mamba_norm_before_gate).
Names: the mixer's tensors under mamba., the MLP's under feed_forward., the norm before it pre_ff_layernorm, the last
norm final_layernorm.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.config_checks import Mamba2
from areal_jax.models.hf_family import common_fields, hf_dict, rename, require_fields
from areal_jax.models.mixer_checks import HybridScales

HF_CLASSES = {"falcon_h1": "FalconH1ForCausalLM"}
_DEFAULTS = dict(vocab_size=128000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, mamba_d_ssm=1024, mamba_n_heads=128,
                 mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True,
                 mamba_proj_bias=False, mamba_rms_norm=False, mamba_norm_before_gate=True)  # transformers' FalconH1Config
_NAMES = ((".mlp.", ".feed_forward."), (".post_attention_layernorm.", ".pre_ff_layernorm."),
          (".linear_attn.", ".mamba."), ("model.norm.", "model.final_layernorm."))
_SCALES = dict(attention_in="attention_in_multiplier", attention_out="attention_out_multiplier", key="key_multiplier",
               ssm_in="ssm_in_multiplier", ssm_out="ssm_out_multiplier", lm_head="lm_head_multiplier")


def hf_name(name: str, cfg: Any = None) -> str:
    """Falcon-H1's name of a tensor the weight table names as Llama's and Granite 4.0-H's (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def _number(x: Any) -> float:
    return float(x["__float__"]) if isinstance(x, dict) else float(x)  # (transformers writes inf as {"__float__": ..})


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Falcon-H1 config.json (transformers' defaults where a key is absent)."""
    fields, get = common_fields(d, model_type, _DEFAULTS, "Falcon-H1")
    biases = {k: d.get(k) for k in ("attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias") if d.get(k)}
    if biases or not get("mamba_conv_bias"):
        raise ValueError(f"Falcon-H1 here has no biases but the convolution's (mamba_conv_bias=true; the released "
                         f"checkpoints'); this config.json sets {biases or {'mamba_conv_bias': False}}.")
    limit = [_number(x) for x in d.get("time_step_limit") or ()]
    if limit and limit != [0.0, float("inf")]:
        raise ValueError(f"time_step_limit={limit}: a clamped time step is not supported here (the released "
                         "checkpoints take (0, inf)).")
    hidden, heads = fields["hidden_size"], int(get("mamba_n_heads"))
    inner = int(get("mamba_d_ssm") or int(get("mamba_expand")) * hidden)
    head_dim = inner // heads if d.get("mamba_d_head") in (None, "auto") else int(d["mamba_d_head"])
    if head_dim * heads != inner:
        raise ValueError(f"Falcon-H1's mamba_n_heads={heads} x mamba_d_head={head_dim} must be the mixer's width "
                         f"{inner} (mamba_d_ssm, else mamba_expand x hidden_size).")
    norm = ("before_gate" if get("mamba_norm_before_gate") else "after_gate") if get("mamba_rms_norm") else None
    mamba = Mamba2(heads, head_dim, int(get("mamba_d_state")), int(get("mamba_n_groups")), int(get("mamba_d_conv")),
                   norm)
    gate, down = [float(x) for x in d.get("mlp_multipliers") or (1.0, 1.0)]
    scales = HybridScales(**{k: float(d.get(key, 1.0)) for k, key in _SCALES.items()}, mlp_gate=gate, mlp_down=down,
                          ssm_parts=tuple(float(x) for x in d.get("ssm_multipliers") or (1.0,) * 5))
    return cls(**fields, layer_types=("hybrid",) * fields["num_layers"], mamba=mamba, hybrid_scales=scales,
               embedding_multiplier=float(d.get("embedding_multiplier", 1.0)), dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' FalconH1ForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Falcon-H1", "attention and a Mamba-2 mixer side by side in every layer (no biases, no q/k "
                   "norm, no windows, full rotary embeddings) and dense MLPs", layer_types=("hybrid",) * cfg.num_layers,
                   attention_bias=False, qk_norm=False, rotary_dim=None, sliding_window=None, rope_layers=None,
                   num_experts=0, attention_multiplier=None, residual_multiplier=None, logits_scaling=None)
    if cfg.hybrid_scales is None or cfg.embedding_multiplier is None:
        raise ValueError("HF Falcon-H1 has its multipliers: set hybrid_scales=HybridScales(...) and "
                         "embedding_multiplier (1.0 where the model has none).")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Falcon-H1 config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    m, s = cfg.mamba, cfg.hybrid_scales
    return hf_dict(common, head_dim=cfg.head_dim, mamba_d_ssm=m.heads * m.head_dim, mamba_n_heads=m.heads,
                   mamba_d_head=m.head_dim, mamba_n_groups=m.groups, mamba_d_state=m.state, mamba_d_conv=m.conv_kernel,
                   mamba_conv_bias=True, mamba_proj_bias=False, mamba_rms_norm=m.norm is not None,
                   mamba_norm_before_gate=m.norm == "before_gate", projectors_bias=False, attention_bias=False,
                   mlp_bias=False, embedding_multiplier=cfg.embedding_multiplier,
                   mlp_multipliers=[s.mlp_gate, s.mlp_down], ssm_multipliers=list(s.ssm_parts),
                   **{key: getattr(s, k) for k, key in _SCALES.items()})
