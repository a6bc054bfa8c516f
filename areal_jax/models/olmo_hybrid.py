"""OLMo Hybrid (`OlmoHybridForCausalLM`): what its config.json means here (`config_from_hf`, `config_to_hf`,
`check_hf`).

Three of every four layers (by default; `layer_types` on disk) are Gated DeltaNet layers (`models.gated_deltanet`)
in a pre-norm layer (input_layernorm, post_attention_layernorm before the MLP), the others OLMo 3's attention layer
(norms after attention and after the MLP only, q/k RMSNorm over all heads together). The Gated DeltaNet projects q,
k and v apart (q_proj, k_proj, v_proj), its output gate z is g_proj, its output projection o_proj; its write strength
is 2 sigmoid(b) where linear_allow_neg_eigval is set (eigenvalues of the transition down to -1), and its gated norm
(o_norm) takes epsilon 1e-5 whatever rms_norm_eps says. (transformers' class would skip RoPE without a base, but its
config class always gives one: 10,000 where the file has none.) On disk its Gated DeltaNet layers' norms may be named
attention_layer_norm / feedforward_layer_norm and its convolution kept as q_conv1d, k_conv1d, v_conv1d
(`disk_names`); this project writes the names transformers holds them under.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.config_checks import LinearAttention
from areal_jax.models.hf_family import hf_dict, reader, require_fields
from areal_jax.models.tensor_layout import Layout

HF_CLASSES = {"olmo_hybrid": "OlmoHybridForCausalLM"}
LAYOUTS = {"olmo_hybrid": Layout(linear="named")}
_DEFAULTS = dict(vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=30, max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 bos_token_id=None, eos_token_id=100257, linear_conv_kernel_dim=4,
                 linear_allow_neg_eigval=True)  # transformers' OlmoHybridConfig, where a config.json leaves a key out


def _types(d: dict, layers: int) -> tuple[str, ...]:
    """layer_types, or transformers' default: every fourth layer attention (the last one if none is)."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return tuple(types)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of an OLMo Hybrid config.json (transformers' defaults where a key is absent)."""
    get = reader(d, _DEFAULTS, none_is_default=True)

    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not OLMo Hybrid's ('silu').")
    if d.get("attention_bias"):
        raise ValueError("attention_bias: OLMo Hybrid has no attention biases, and biases beside OLMo's q/k norm are "
                         "not supported here.")
    layers, heads, hidden = int(get("num_hidden_layers")), int(get("num_attention_heads")), int(get("hidden_size"))
    types = _types(d, layers)
    if len(types) != layers or any(t not in ("full_attention", "linear_attention") for t in types) or \
            len(set(types)) != 2:
        raise ValueError(f"OLMo Hybrid's layer_types hold num_hidden_layers={layers} entries, each full_attention or "
                         f"linear_attention, both kinds present; got {list(types)}.")
    key_heads = int(d.get("linear_num_key_heads") or heads)
    key_dim = int(d.get("linear_key_head_dim") or int(0.75 * hidden / key_heads))
    linear = LinearAttention(key_heads, int(d.get("linear_num_value_heads") or heads), key_dim,
                             int(d.get("linear_value_head_dim") or 2 * key_dim), int(get("linear_conv_kernel_dim")),
                             2.0 if get("linear_allow_neg_eigval") else 1.0)
    rope = d.get("rope_parameters") or {}
    theta = rope.get("rope_theta", d.get("rope_theta")) or 10000.0  # (transformers' default base, even for null)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"OLMo Hybrid's rope_parameters {rope}: only the default RoPE is supported.")
    eos = get("eos_token_id")
    return cls(architecture=model_type, vocab_size=int(get("vocab_size")), hidden_size=hidden,
               intermediate_size=int(get("intermediate_size")), num_layers=layers, num_heads=heads,
               num_kv_heads=int(d.get("num_key_value_heads") or heads), head_dim=hidden // heads,
               rope_theta=float(theta),
               rms_norm_eps=float(get("rms_norm_eps")), tie_word_embeddings=bool(get("tie_word_embeddings")),
               max_position_embeddings=int(get("max_position_embeddings")), bos_token_id=get("bos_token_id"),
               eos_token_id=tuple(eos) if isinstance(eos, list) else eos, qk_norm=True, layer_types=types,
               linear=linear, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' OlmoHybridForCausalLM would not load as it is (and its doubled write strength
    elsewhere)."""
    if cfg.architecture not in HF_CLASSES:
        if cfg.linear is not None and cfg.linear.beta_scale != 1.0:
            raise ValueError(f"linear.beta_scale={cfg.linear.beta_scale} is OLMo Hybrid's (2: negative eigenvalues); "
                             f"HF {cfg.architecture} has 1.")
        return
    require_fields(cfg, "OLMo Hybrid", "OLMo 3's attention (q/k norm over all heads, no biases, plain full-width RoPE "
                   "in every attention layer, no windows) and dense MLPs", attention_bias=False, qk_norm=True,
                   rotary_dim=None, sliding_window=None, rope_scaling=None, rope_layers=None, num_experts=0)
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise ValueError(f"HF OLMo Hybrid has head_dim = hidden_size / num_heads ({cfg.hidden_size // cfg.num_heads}); "
                         f"got {cfg.head_dim}.")
    if cfg.linear.beta_scale not in (1.0, 2.0):
        raise ValueError(f"HF OLMo Hybrid's write strength is 1 or 2 times sigmoid(b) (linear_allow_neg_eigval); got "
                         f"linear.beta_scale={cfg.linear.beta_scale}.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of an OLMo Hybrid config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    m = cfg.linear
    common = {k: v for k, v in common.items() if k not in ("head_dim", "rope_theta")}
    types = ["linear_attention" if cfg.layer_is_linear(i) else "full_attention" for i in range(cfg.num_layers)]
    return hf_dict(common, layer_types=types, attention_bias=False, linear_num_key_heads=m.key_heads,
                   linear_num_value_heads=m.value_heads, linear_key_head_dim=m.key_dim, linear_value_head_dim=m.value_dim,
                   linear_conv_kernel_dim=m.conv_kernel, linear_allow_neg_eigval=m.beta_scale == 2.0, pad_token_id=None)
