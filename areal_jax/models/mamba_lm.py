"""Mamba (`MambaForCausalLM`: state-spaces/mamba-130m ... 2.8b), Falcon-Mamba (`FalconMambaForCausalLM`:
Falcon-Mamba-7B) and Mamba-2 (`Mamba2ForCausalLM`: mamba2-130m ... 2.7b, Mamba-Codestral-7B): what their config.json
means here (`config_from_hf`, `config_to_hf`, `check_hf`) and their tensors' names (`hf_name`).

A stack of blocks x + mixer(norm(x)) with no attention and no feed-forward: every layer is a Mamba mixer
(`models.mamba1`: expand x hidden_size channels of state_size states, a time step of rank time_step_rank ("auto":
hidden_size / 16), conv_kernel taps; Falcon-Mamba RMS-normalises the time step's input, B and C without scales, with
epsilon mixer_rms_eps) alone (`ModelConfig.mlp_layers` all 0); Mamba-2's is a Mamba-2 mixer (`models.mamba2`:
num_heads heads of head_dim = expand x hidden_size channels, n_groups groups of B and C of state_size, its output's
grouped norm after the gate). Names: backbone.embeddings, backbone.layers.{i}.norm and .mixer.*, backbone.norm_f.
chunk_size (the scan's chunks) changes how, not what, is computed. The attention fields of the ModelConfig (heads, head_dim, intermediate_size) are unused
placeholders. residual_in_fp32 (true by default, as in the released checkpoints): the residual stream stays float32
whatever the compute dtype, each block's norm taking it rounded to the compute dtype (`ModelConfig.residual_in_fp32`).
"""
from __future__ import annotations

import math
import re
from typing import Any

import jax.numpy as jnp

from areal_jax.models.config_checks import Mamba1, Mamba2
from areal_jax.models.hf_family import hf_dict, reader, rename, require_fields

HF_CLASSES = {"mamba": "MambaForCausalLM", "falcon_mamba": "FalconMambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}
_DEFAULTS = dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=32, layer_norm_epsilon=1e-5,
                 bos_token_id=0, eos_token_id=0, expand=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
                 hidden_act="silu", time_step_rank="auto", tie_word_embeddings=True,
                 mixer_rms_eps=1e-6, residual_in_fp32=True)  # transformers' MambaConfig, FalconMambaConfig
_MAMBA2_DEFAULTS = dict(_DEFAULTS, num_heads=128, head_dim=64, vocab_size=32768, hidden_size=4096, state_size=128,
                        num_hidden_layers=64, bos_token_id=0, eos_token_id=2, n_groups=8,
                        tie_word_embeddings=False)  # transformers' Mamba2Config
_NAMES = ((re.compile(r"^model\.embed_tokens\."), "backbone.embeddings."), (re.compile(r"^model\.norm\."), "backbone.norm_f."),
          (re.compile(r"^model\.layers\.(\d+)\.input_layernorm\."), r"backbone.layers.\1.norm."),
          (re.compile(r"^model\.layers\.(\d+)\.(mamba|linear_attn)\."), r"backbone.layers.\1.mixer."))
_PLACEHOLDERS = dict(num_heads=1, num_kv_heads=1, head_dim=2, intermediate_size=1)  # (no attention, no MLP)
CONTEXT = 1 << 20  # the positions a run may reach (a Mamba model has no position table)


def hf_name(name: str, cfg: Any = None) -> str:
    """Mamba's name of a tensor the weight table names as Llama's (`hf_names.weight_entries`)."""
    return rename(name, _NAMES)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Mamba, Falcon-Mamba or Mamba-2 config.json (transformers' defaults where a key is absent)."""
    get = reader(d, _MAMBA2_DEFAULTS if model_type == "mamba2" else _DEFAULTS)
    if get("use_bias") or not get("use_conv_bias") or get("hidden_act") != "silu":
        raise ValueError(f"{HF_CLASSES[model_type].removesuffix('ForCausalLM')} here has a convolution bias, no projection biases and SiLU (use_bias=false, "
                         "use_conv_bias=true, hidden_act='silu'), as the released checkpoints have; this config.json "
                         f"sets {dict(use_bias=get('use_bias'), use_conv_bias=get('use_conv_bias'), hidden_act=get('hidden_act'))}.")
    hidden, layers = int(get("hidden_size")), int(get("num_hidden_layers"))
    if model_type == "mamba2":
        return cls(**_fields(get, model_type, hidden, layers), mamba=_mamba2_shapes(d, get, hidden), dtype=dtype,
                   param_dtype=param_dtype)
    rank = get("time_step_rank")
    rank = math.ceil(hidden / 16) if rank == "auto" else int(rank)
    falcon = model_type == "falcon_mamba"
    mamba = Mamba1(int(get("expand")) * hidden, int(get("state_size")), rank, int(get("conv_kernel")),
                   "plain" if falcon else None, float(get("mixer_rms_eps")) if falcon else None)
    return cls(**_fields(get, model_type, hidden, layers), mamba1=mamba, dtype=dtype, param_dtype=param_dtype)


def _fields(get: Any, model_type: str, hidden: int, layers: int) -> dict:
    """The ModelConfig fields the three families share: sizes, norms, tying, special tokens, every layer a mixer alone."""
    eos = get("eos_token_id")
    return dict(architecture=model_type, vocab_size=int(get("vocab_size")), hidden_size=hidden, num_layers=layers,
                **_PLACEHOLDERS, rms_norm_eps=float(get("layer_norm_epsilon")),
                tie_word_embeddings=bool(get("tie_word_embeddings")), max_position_embeddings=CONTEXT,
                bos_token_id=get("bos_token_id"), eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
                layer_types=("linear_attention",) * layers, mlp_layers=(0,) * layers,
                residual_in_fp32=bool(get("residual_in_fp32")))


def _mamba2_shapes(d: dict, get: Any, hidden: int) -> Mamba2:
    """Mamba-2's mixer shapes (num_heads x head_dim must be expand x hidden_size, as transformers checks); a clamped
    time step is refused."""
    limit = [float(x["__float__"]) if isinstance(x, dict) else float(x) for x in d.get("time_step_limit") or ()]
    if limit and limit != [0.0, float("inf")]:  # (transformers writes infinity as {"__float__": "Infinity"})
        raise ValueError(f"time_step_limit={limit}: a clamped time step is not supported here (the released "
                         "checkpoints take (0, inf)).")
    heads, head_dim = int(get("num_heads")), int(get("head_dim"))
    if heads * head_dim != int(get("expand")) * hidden:
        raise ValueError(f"Mamba-2's num_heads x head_dim ({heads} x {head_dim}) must equal expand x hidden_size "
                         f"({get('expand')} x {hidden}).")
    return Mamba2(heads, head_dim, int(get("state_size")), int(get("n_groups")), int(get("conv_kernel")))


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' MambaForCausalLM / FalconMambaForCausalLM / Mamba2ForCausalLM would not load as
    it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, HF_CLASSES[cfg.architecture], "Mamba mixers alone in every layer (no attention, no MLP)",
                   layer_types=("linear_attention",) * cfg.num_layers, mlp_layers=(0,) * cfg.num_layers, num_experts=0,
                   rope_scaling=None)
    if cfg.architecture == "mamba2":
        m = cfg.mamba
        if m is None or m.heads * m.head_dim % cfg.hidden_size or m.norm != "after_gate":
            raise ValueError(f"HF Mamba2ForCausalLM's mixers are Mamba-2's with heads x head_dim a multiple of "
                             f"hidden_size and their output normalised after the gate; mamba={m} is not.")
        return
    m, falcon = cfg.mamba1, cfg.architecture == "falcon_mamba"
    if m is None or m.inner % cfg.hidden_size or m.norms != ("plain" if falcon else None) or \
            (m.norm_eps is None) == falcon:
        raise ValueError(f"HF {HF_CLASSES[cfg.architecture]}'s mixers have expand x hidden_size channels and "
                         f"{'unscaled norms with their own epsilon' if falcon else 'no norms'} of the time step's "
                         f"input, B and C; mamba1={m} has not.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Mamba, Falcon-Mamba or Mamba-2 config: `common` (hf_config's keys every family writes, less the
    attention's and the MLP's) with its own."""
    check_hf(cfg)
    if cfg.architecture == "mamba2":
        m = cfg.mamba
        own = dict(num_heads=m.heads, head_dim=m.head_dim, state_size=m.state, n_groups=m.groups,
                   conv_kernel=m.conv_kernel, expand=m.heads * m.head_dim // cfg.hidden_size, use_bias=False,
                   use_conv_bias=True)
    else:
        m = cfg.mamba1
        own = dict(state_size=m.state, expand=m.inner // cfg.hidden_size, conv_kernel=m.conv_kernel,
                   time_step_rank=m.dt_rank, use_bias=False, use_conv_bias=True)
    own.update(layer_norm_epsilon=cfg.rms_norm_eps, residual_in_fp32=cfg.residual_in_fp32)
    if cfg.architecture == "falcon_mamba":
        own["mixer_rms_eps"] = m.norm_eps
    dropped = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
               "max_position_embeddings", "rope_theta", "rope_parameters", "attention_dropout")
    return hf_dict({k: v for k, v in common.items() if k not in dropped}, **own)
