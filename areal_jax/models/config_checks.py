"""Checks of `ModelConfig` fields that need more than a line (kept apart so config.py stays a table of fields)."""
from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from areal_jax.models.mixer_checks import HybridScales, Mamba1, _check_hybrid, _check_mamba1, _named  # noqa: F401


def layer_flags(cfg, name: str, meaning: str) -> tuple[int, ...] | None:
    """ModelConfig field `name`, a per-layer tuple of 0 / 1 flags (or None), made a tuple of ints and checked."""
    if getattr(cfg, name) is None:
        return None
    flags = tuple(int(x) for x in getattr(cfg, name))
    object.__setattr__(cfg, name, flags)
    if len(flags) != cfg.num_layers or any(x not in (0, 1) for x in flags):
        raise ValueError(f"ModelConfig.{name} must hold num_layers={cfg.num_layers} flags, each 1 {meaning}; got "
                         f"{list(flags)}.")
    return flags


def check_attention_layout(cfg, layer_types: tuple[str, ...]) -> None:
    """ModelConfig's sliding window, layer types (each one of `layer_types`), per-layer flags (rope_layers,
    mlp_layers), query scalar and local RoPE base; the layer types are made a tuple."""
    window, types = cfg.sliding_window, cfg.layer_types
    if window is not None and (not isinstance(window, (int, np.integer)) or isinstance(window, bool)
                               or window < 1):
        raise ValueError(f"ModelConfig.sliding_window must be a positive integer or None, got {window!r}.")
    if types is not None:
        types = tuple(types)
        object.__setattr__(cfg, "layer_types", types)
        if len(types) != cfg.num_layers or any(t not in layer_types for t in types):
            raise ValueError(f"ModelConfig.layer_types must hold num_layers={cfg.num_layers} entries, each one of "
                             f"{', '.join(layer_types)}; got {list(types)}.")
        if "sliding_attention" in types and window is None:
            raise ValueError("ModelConfig.layer_types has sliding_attention layers but sliding_window is None; "
                             "set the window (positions each query looks back over).")
    layer_flags(cfg, "rope_layers", "(rotary embeddings) or 0 (none)")
    layer_flags(cfg, "mlp_layers", "(a feed-forward after the token mixer) or 0 (none)")
    if cfg.query_pre_attn_scalar is not None and not float(cfg.query_pre_attn_scalar) > 0:
        raise ValueError(f"ModelConfig.query_pre_attn_scalar must be positive, got {cfg.query_pre_attn_scalar}.")
    if cfg.rope_local_theta is not None and not float(cfg.rope_local_theta) > 0:
        raise ValueError(f"ModelConfig.rope_local_theta must be positive, got {cfg.rope_local_theta}.")


def check_residual(cfg) -> None:
    """A float32 residual stream (`residual_in_fp32`) is modelled for blocks x + mixer(norm(x)) alone: every layer
    without a feed-forward (Mamba's, Falcon-Mamba's, Mamba-2's)."""
    if cfg.residual_in_fp32 and any(cfg.layer_has_mlp(i) for i in range(cfg.num_layers)):
        raise ValueError("residual_in_fp32=True is supported for layers without a feed-forward (mlp_layers all 0: the "
                         "Mamba families' blocks x + mixer(norm(x))); set residual_in_fp32=False.")


def check_longrope(scaling: dict, rope_dim: int, max_position_embeddings: int) -> None:
    """LongRoPE's keys in `scaling` (changed in place), completed as transformers completes them (factor from the
    context lengths); its factor lists become tuples of floats (the config stays hashable)."""
    if scaling.get("original_max_position_embeddings") is None:
        raise ValueError(f"rope_scaling of type 'longrope' needs original_max_position_embeddings; got {scaling}.")
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, (list, tuple)) or len(values) != rope_dim // 2:
            raise ValueError(f"rope_scaling of type 'longrope' needs {key} as a list of rotary_dim / 2 = "
                             f"{rope_dim // 2} numbers; got {values!r}.")
        scaling[key] = tuple(float(v) for v in values)
    if scaling.get("factor") is None:
        scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    scaling["use_long_factor"] = bool(scaling.get("use_long_factor", False))


def check_gated_experts(cfg) -> None:
    """gpt-oss's expert fields: the clamped GLU's limit and alpha, and biases only where there are experts."""
    limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
    if limit is not None and not (isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0):
        raise ValueError(f"ModelConfig.swiglu_limit must be a positive number or None, got {limit!r}.")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0):
        raise ValueError(f"ModelConfig.swiglu_alpha must be a positive number, got {alpha!r}.")
    clip = cfg.clip_qkv  # (OLMo's, checked here beside the other clamp)
    if clip is not None and not (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0):
        raise ValueError(f"ModelConfig.clip_qkv must be a positive number or None, got {clip!r}.")
    if (cfg.expert_bias or limit is not None) and not cfg.num_experts:
        raise ValueError("ModelConfig.expert_bias and swiglu_limit apply to a mixture of experts; this config has "
                         "num_experts=0. Leave them at False / None.")


class MLA(NamedTuple):
    """Multi-head latent attention's shapes (DeepSeek-V2 / V3; `models.mla`): queries through a rank-`q_lora_rank`
    bottleneck (None: one projection), keys and values from one shared latent of `kv_lora_rank` plus a rotary key of
    `rope` dimensions shared by the heads; each head's query and key hold `nope` dimensions without rotation and
    `rope` with, its value `v`. interleave: the rotary dimensions are laid out as pairs (x0, x1), (x2, x3), ...
    (DeepSeek's checkpoints; transformers' rope_interleave) rather than as two halves."""
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v: int
    interleave: bool = True


def check_mla(cfg) -> None:
    """`ModelConfig.mla` made an `MLA` (from a tuple or dict) and checked against the attention fields it fixes:
    head_dim = nope + rope (the keys' width; values are padded to it), one key/value head per query head."""
    m = cfg.mla
    if m is None:
        return
    m = _named(MLA, m, "mla")
    object.__setattr__(cfg, "mla", m)
    sizes = [m.kv_lora_rank, m.nope, m.rope, m.v] + ([] if m.q_lora_rank is None else [m.q_lora_rank])
    if any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in sizes) or m.rope % 2:
        raise ValueError(f"ModelConfig.mla needs positive integer sizes and an even rope width; got {m}.")
    if cfg.head_dim != m.nope + m.rope or cfg.num_kv_heads != cfg.num_heads or m.v > cfg.head_dim:
        raise ValueError(f"latent attention {m} needs head_dim = nope + rope = {m.nope + m.rope}, num_kv_heads = "
                         f"num_heads = {cfg.num_heads} and v <= head_dim; got head_dim={cfg.head_dim}, num_kv_heads="
                         f"{cfg.num_kv_heads}.")
    if cfg.attention_bias or cfg.qk_norm or cfg.rotary_dim is not None or cfg.attention_sinks or cfg.rope_interleave:
        raise ValueError("latent attention has its own projections, norms and rotary layout (MLA.interleave): set "
                         "attention_bias=False, qk_norm=False, rotary_dim=None, attention_sinks=False, "
                         "rope_interleave=False.")


def check_rotary(cfg) -> None:
    """rotary_dim: an even number of a head's dimensions (all of them is stored as None); rope_interleave a bool."""
    if cfg.rotary_dim is not None:
        if not isinstance(cfg.rotary_dim, (int, np.integer)) or not 2 <= cfg.rotary_dim <= cfg.head_dim \
                or cfg.rotary_dim % 2:
            raise ValueError(f"ModelConfig.rotary_dim must be an even number in [2, head_dim={cfg.head_dim}] "
                             f"or None, got {cfg.rotary_dim!r}.")
        if cfg.rotary_dim == cfg.head_dim:
            object.__setattr__(cfg, "rotary_dim", None)
    if not isinstance(cfg.rope_interleave, bool):
        raise ValueError(f"ModelConfig.rope_interleave must be True or False, got {cfg.rope_interleave!r}.")


ROUTER_SCORINGS = ("softmax", "sigmoid", "sparsemixer")


def to_dtype(value, field: str) -> np.dtype:
    """ModelConfig's `field` as a numpy dtype: float32, bfloat16 or float16, else a ValueError naming it."""
    try:
        dt = jnp.dtype(value)
    except TypeError as err:
        raise ValueError(f"ModelConfig.{field}={value!r} is not a dtype; use jnp.float32 or jnp.bfloat16.") from err
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"ModelConfig.{field}={dt} is not supported; use float32, bfloat16 or float16.")
    return dt


def check_routing(cfg) -> None:
    """The router's fields beyond top-k (DeepSeek-V3's): sigmoid scores, a per-expert bias that only picks, the
    experts picked within the best groups, the weights times a factor; and the shared expert's gate."""
    if cfg.router_scoring not in ROUTER_SCORINGS:
        raise ValueError(f"ModelConfig.router_scoring={cfg.router_scoring!r}; use one of {', '.join(ROUTER_SCORINGS)}.")
    factor = cfg.routed_scaling_factor
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
        raise ValueError(f"ModelConfig.routed_scaling_factor must be a positive number, got {factor!r}.")
    if cfg.router_groups is not None:
        groups = tuple(cfg.router_groups)
        object.__setattr__(cfg, "router_groups", groups)
        e = cfg.num_experts
        if len(groups) != 2 or not all(isinstance(g, int) and g >= 1 for g in groups) or e % groups[0] \
                or e // groups[0] < 2 or groups[1] > groups[0] or groups[1] * (e // groups[0]) < cfg.num_experts_per_tok:
            raise ValueError(f"ModelConfig.router_groups=(n_group, topk_group) must split num_experts={e} into "
                             f"n_group groups of at least 2 and keep topk_group <= n_group groups holding at least "
                             f"num_experts_per_tok={cfg.num_experts_per_tok} experts; got {cfg.router_groups!r}.")
    jitter = cfg.router_jitter
    if not isinstance(jitter, (int, float)) or isinstance(jitter, bool) or not 0 <= jitter < 0.5:
        raise ValueError(f"ModelConfig.router_jitter (sparsemixer's relative margin) must lie in [0, 0.5), got {jitter!r}.")
    if cfg.router_scoring == "sparsemixer" and (cfg.router_groups is not None or cfg.router_score_bias or cfg.norm_topk_prob):
        raise ValueError("router_scoring='sparsemixer' picks and weighs on its own: set router_groups=None, "
                         "router_score_bias=False and norm_topk_prob=False.")
    if cfg.lm_head_bias and cfg.tie_word_embeddings:
        raise ValueError("lm_head_bias needs an output matrix of its own; set tie_word_embeddings=False.")
    own = (cfg.router_scoring != "softmax" or cfg.router_groups is not None or cfg.router_score_bias
           or factor != 1.0)
    if own and not cfg.num_experts:
        raise ValueError("router_scoring, router_groups, router_score_bias and routed_scaling_factor apply to a "
                         "mixture of experts; this config has num_experts=0.")
    if not cfg.shared_expert_gated and not cfg.shared_expert_size:
        raise ValueError("shared_expert_gated=False describes a shared expert; set shared_expert_size too.")


def check_experts(cfg) -> None:
    """The mixture-of-experts fields: counts, widths, `moe_impl`, and which layers have experts (`moe_layers`: all
    of them is stored as None)."""
    from areal_jax.models.config import EXPERT_DISPATCHES, MOE_ARCHITECTURES, MOE_IMPLS  # noqa: PLC0415 (a cycle)

    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if not isinstance(e, (int, np.integer)) or e < 0 or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"ModelConfig.num_experts and num_experts_per_tok must be integers >= 0, got {e!r} and "
                         f"{k!r}.")
    if cfg.moe_impl not in MOE_IMPLS:
        raise ValueError(f"ModelConfig.moe_impl={cfg.moe_impl!r} is unknown; use one of {', '.join(MOE_IMPLS)}.")
    if cfg.expert_dispatch not in EXPERT_DISPATCHES:
        raise ValueError(f"ModelConfig.expert_dispatch={cfg.expert_dispatch!r} is unknown; use one of "
                         f"{', '.join(EXPERT_DISPATCHES)}.")
    if (cfg.architecture in MOE_ARCHITECTURES) != (e > 0) and cfg.architecture not in ("granitemoehybrid", "nemotron_h",
                                                                                     "jamba"):
        # (Granite 4.0, Nemotron-H: dense or not)
        raise ValueError(f"architecture {cfg.architecture!r} with num_experts={e}: the mixture-of-experts "
                         f"architectures ({', '.join(MOE_ARCHITECTURES)}) need num_experts >= 1, the others take 0.")
    if e and not 1 <= k <= e:
        raise ValueError(f"ModelConfig.num_experts_per_tok must lie in [1, num_experts={e}], got {k}.")
    for name in ("moe_intermediate_size", "shared_expert_size"):
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, (int, np.integer)) or value <= 0):
            raise ValueError(f"ModelConfig.{name} must be a positive integer or None, got {value!r}.")
    flags = layer_flags(cfg, "moe_layers", "(experts) or 0 (a dense MLP)")
    if flags is not None and all(flags):
        object.__setattr__(cfg, "moe_layers", None)


def mla_query_factor(cfg) -> float:
    """What latent attention's queries are multiplied by so that the attention paths' 1 / sqrt(head_dim) gives
    DeepSeek's softmax scale: (0.1 mscale_all_dim ln(factor) + 1) ** 2 under a RoPE scaling that sets mscale_all_dim
    (transformers' yarn_apply_mscale), else 1."""
    s = cfg.rope_scaling
    if s is None or not s.get("mscale_all_dim"):
        return 1.0
    factor = float(s["factor"])
    m = 1.0 if factor <= 1 else 0.1 * float(s["mscale_all_dim"]) * math.log(factor) + 1.0
    return m * m


def check_rope_scaling(cfg) -> None:
    """`ModelConfig.rope_scaling` checked and completed as transformers completes it (the type under "rope_type"; None
    for the default type)."""
    from areal_jax.models.config import _LLAMA3_KEYS, _ROPE_TYPES  # noqa: PLC0415 (a cycle)

    if cfg.rope_scaling is not None:
        scaling = dict(cfg.rope_scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported types are "
                             f"{', '.join(_ROPE_TYPES)} (or rope_scaling=None).")
        if rope_type in ("linear", "dynamic") and not float(scaling.get("factor") or 0) > 0:
            raise ValueError(f"rope_scaling of type {rope_type!r} needs a positive factor; got {scaling}.")
        if rope_type == "llama3":
            missing = [k for k in _LLAMA3_KEYS if k not in scaling]
            if missing:
                raise ValueError(f"rope_scaling of type 'llama3' needs keys {', '.join(missing)}; got {scaling}.")
        if rope_type == "yarn":
            if scaling.get("original_max_position_embeddings") is None:  # as transformers: the model's own
                scaling["original_max_position_embeddings"] = cfg.max_position_embeddings
            if scaling.get("factor") is None:
                scaling["factor"] = cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
            if not float(scaling["factor"]) > 0:
                raise ValueError(f"rope_scaling of type 'yarn' needs a positive factor; got {scaling}.")
        if rope_type == "longrope":
            check_longrope(scaling, cfg.rope_dim, cfg.max_position_embeddings)
        if rope_type == "proportional" and not 0 < float(scaling.get("partial_rotary_factor", 1.0)) <= 1:
            raise ValueError(f"rope_scaling of type 'proportional' needs partial_rotary_factor in (0, 1]; got {scaling}.")
        if rope_type == "proportional":
            scaling.setdefault("partial_rotary_factor", 1.0)
        scaling.pop("type", None)
        scaling["rope_type"] = rope_type
        object.__setattr__(cfg, "rope_scaling", None if rope_type == "default" else scaling)


class LinearAttention(NamedTuple):
    """Gated DeltaNet's shapes (Qwen3.5's linear-attention layers; `models.gated_deltanet`): `key_heads` query / key
    heads of `key_dim`, `value_heads` value heads of `value_dim` (a multiple of key_heads: each query / key head
    serves value_heads / key_heads of them), and a causal depthwise convolution of `conv_kernel` taps over the
    projected queries, keys and values. beta_scale: the write strength is beta_scale * sigmoid(b) (2 where OLMo Hybrid
    allows negative eigenvalues, linear_allow_neg_eigval)."""
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    beta_scale: float = 1.0


class Mamba2(NamedTuple):
    """A Mamba-2 mixer's shapes (Granite 4.0-H's "linear_attention" layers: `models.mamba2`): `heads` heads of
    `head_dim`, `groups` groups of B and C of `state` each (heads / groups heads to a group), a convolution of
    `conv_kernel` taps; `norm`: the output's grouped RMSNorm "after_gate" (of y silu(z)), "before_gate" (of y, then
    times silu(z)) or None (none: y silu(z), Falcon-H1 without mamba_rms_norm)."""
    heads: int
    head_dim: int
    state: int
    groups: int = 1
    conv_kernel: int = 4
    norm: str | None = "after_gate"


def check_linear(cfg) -> None:
    """`ModelConfig.linear` made a `LinearAttention` (from a tuple or dict) and checked against layer_types: the
    "linear_attention" layers need it, and it needs at least one of them (`short_conv` likewise with "conv" layers)."""
    _check_short_conv(cfg)
    _check_mamba(cfg)
    _check_mamba1(cfg)
    _check_hybrid(cfg)
    m, types = cfg.linear, cfg.layer_types or ()
    if m is None:
        if "linear_attention" in types and cfg.mamba is None and cfg.mamba1 is None:
            raise ValueError("ModelConfig.layer_types has linear_attention layers but linear is None; set linear="
                             "LinearAttention(key_heads, value_heads, key_dim, value_dim, conv_kernel).")
        return
    m = _named(LinearAttention, m, "linear")
    if any(not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1 for x in m[:5]):
        raise ValueError(f"ModelConfig.linear's shapes must be positive integers, got {m}.")
    if not isinstance(m.beta_scale, (int, float, np.floating)) or isinstance(m.beta_scale, bool) or m.beta_scale <= 0:
        raise ValueError(f"ModelConfig.linear.beta_scale must be a positive number, got {m.beta_scale!r}.")
    if m.value_heads % m.key_heads or m.conv_kernel < 2:
        raise ValueError(f"ModelConfig.linear needs value_heads a multiple of key_heads and conv_kernel >= 2, got {m}.")
    if "linear_attention" not in types:
        raise ValueError("ModelConfig.linear is set but no layer is linear_attention: list them in layer_types, or "
                         "leave linear None.")
    object.__setattr__(cfg, "linear", m)


def _check_short_conv(cfg) -> None:
    """`ModelConfig.short_conv` (taps >= 2) set exactly where layer_types has "conv" layers."""
    taps, types = cfg.short_conv, cfg.layer_types or ()
    if taps is None:
        if "conv" in types:
            raise ValueError("ModelConfig.layer_types has conv layers but short_conv is None; set short_conv to their "
                             "convolution's taps (LFM2's conv_L_cache, 3).")
        return
    if not isinstance(taps, (int, np.integer)) or isinstance(taps, bool) or taps < 2:
        raise ValueError(f"ModelConfig.short_conv must be an integer >= 2 (the convolution's taps), got {taps!r}.")
    if cfg.linear is not None:
        raise ValueError("ModelConfig.short_conv and linear are both set: a model's stateful layers are of one kind "
                         "here (LFM2's short convolutions or Gated DeltaNet); leave one None.")
    if "conv" not in types:
        raise ValueError("ModelConfig.short_conv is set but no layer is conv: list them in layer_types, or leave "
                         "short_conv None.")


def check_head_gate(cfg) -> None:
    """`ModelConfig.head_gate` (LFM3's g_proj) only with plain attention: latent attention and Qwen3.5's gated
    q_proj have gates of their own form."""
    if cfg.head_gate and (cfg.mla is not None or cfg.gated_attention):
        raise ValueError("ModelConfig.head_gate (a per-head output gate, LFM3's) is not supported with latent attention "
                         "or Qwen3.5's gated q_proj; set head_gate=False.")


def _check_mamba(cfg) -> None:
    """`ModelConfig.mamba` made a `Mamba2` and checked: its "linear_attention" layers are Mamba-2's (not Gated
    DeltaNet's), at least one of them."""
    if cfg.mamba is None:
        return
    m = _named(Mamba2, cfg.mamba, "mamba")
    if any(not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1 for x in m[:5]) or m.heads % m.groups \
            or m.conv_kernel < 2 or m.norm not in ("after_gate", "before_gate", None):
        raise ValueError(f"ModelConfig.mamba needs positive integers, heads a multiple of groups, conv_kernel >= 2 and "
                         f"norm one of 'after_gate', 'before_gate', None; got {m}.")
    if cfg.linear is not None or cfg.short_conv is not None or \
            not {"linear_attention", "hybrid"} & set(cfg.layer_types or ()):
        raise ValueError("ModelConfig.mamba makes the linear_attention layers Mamba-2's (and the hybrid layers' mixers): "
                         "it needs some, and linear and short_conv None.")
    object.__setattr__(cfg, "mamba", m)
