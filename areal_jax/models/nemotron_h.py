"""Nemotron-H (`NemotronHForCausalLM`: Nemotron-H 4B / 8B, NVIDIA-Nemotron-Nano-9B-v2 / 12B-v2): what its config.json
means here (`config_from_hf`, `config_to_hf`, `check_hf`) and its tensors' names (`hf_name`).

Its blocks each hold one pre-normed mixer with a residual: a Mamba-2 mixer ("M", `models.mamba2`: mamba_num_heads of
mamba_head_dim, n_groups groups of B and C of ssm_state_size, conv_kernel taps with a bias), attention without any
position embedding ("*"), an ungated MLP down(relu(up x)^2) ("-"), or experts ("E": Nemotron 3 Nano's): n_routed_experts
ungated experts of moe_intermediate_size, each token's num_experts_per_tok picked by DeepSeek-V3's router (sigmoid
scores plus a picking bias, e_score_correction_bias; n_group groups of which topk_group are kept; the weights
renormalised with norm_topk_prob, times routed_scaling_factor) and one ungated shared expert of
moe_shared_expert_intermediate_size. The order is the config's layers_block_type (or its older hybrid_override_pattern
string). Here a mixer and the MLP or experts block after it are one decoder layer (its input norm the mixer block's
norm, its norm before the feed-forward the next block's), and a mixer followed by another mixer is a layer without a
feed-forward (`ModelConfig.mlp_layers`). A feed-forward block that follows no mixer, experts through a latent
projection (moe_latent_size), biases and a sliding window are refused; multi-token prediction layers
(num_nextn_predict_layers) are not built (transformers' class has none either). residual_in_fp32 changes nothing, as in
transformers' class (its blocks add in the compute dtype).

Checkpoints name their tensors backbone.embeddings, backbone.layers.{b}.norm / .mixer.*, backbone.norm_f and lm_head
(the released ones, and transformers writes them so); transformers' modules are model.* (`disk_names.in_memory`).
"""
from __future__ import annotations

import functools
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from areal_jax.models.config_checks import Mamba2
from areal_jax.models.hf_family import hf_dict, reader, require_fields

HF_CLASSES = {"nemotron_h": "NemotronHForCausalLM"}
_DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, layer_norm_epsilon=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, mamba_num_heads=128, mamba_head_dim=64,
                 ssm_state_size=128, n_groups=8, conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688, routed_scaling_factor=1.0,
                 n_group=1, topk_group=1, norm_topk_prob=True)  # transformers' NemotronHConfig, where a key is absent
_LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias",
           "mamba_dt_limit": "time_step_limit", "num_local_experts": "n_routed_experts"}  # older keys it still reads
_PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_KINDS = {"M": "linear_attention", "mamba": "linear_attention", "linear_attention": "linear_attention",
          "*": "full_attention", "attention": "full_attention", "full_attention": "full_attention",
          "-": "mlp", "mlp": "mlp", "E": "moe", "moe": "moe"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.([a-z_]+)\.(.*)$")


def blocks(d: dict) -> list[str]:
    """The config.json's blocks in order, each "linear_attention" (Mamba-2), "full_attention", "mlp" or "moe"."""
    raw = d.get("layers_block_type") or d.get("layer_types") or d.get("hybrid_override_pattern")
    if not raw:
        raise ValueError("A Nemotron-H config.json names its blocks in layers_block_type (or hybrid_override_pattern, "
                         "e.g. 'M-M*-'); this one has neither.")
    kinds = [_KINDS.get(k) for k in (list(raw) if isinstance(raw, str) else raw)]
    if None in kinds:
        raise ValueError(f"Nemotron-H's blocks are mamba (M), attention (*), mlp (-) or moe (E); got {raw!r}.")
    return kinds


_FFN = ("mlp", "moe")


def layers_of(kinds: list[str]) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """(our layers' types, their feed-forward flags, their experts flags): each mixer block with the MLP or experts
    block after it, if any, as one layer."""
    types, ffns, moes = [], [], []
    for b, kind in enumerate(kinds):
        if kind not in _FFN:
            after = kinds[b + 1] if b + 1 < len(kinds) else None
            types.append(kind)
            ffns.append(int(after in _FFN))
            moes.append(int(after == "moe"))
        elif b == 0 or kinds[b - 1] in _FFN:
            raise ValueError(f"Nemotron-H block {b} ({kind}) follows no mixer; each MLP or experts block here follows a "
                             "Mamba-2 or attention block (as in the released models).")
    return tuple(types), tuple(ffns), tuple(moes)


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a Nemotron-H config.json (transformers' defaults where a key is absent)."""
    d = {**{new: d[old] for old, new in _LEGACY.items() if old in d and new not in d}, **d}
    get = reader(d, _DEFAULTS, none_is_default=True)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if d.get(key, want) != want:
            raise ValueError(f"{key}={d[key]!r}: Nemotron-H here has {want!r} there (as the released models).")
    biases = [k for k in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias") if d.get(k)]
    if biases or not d.get("use_conv_bias", True) or d.get("sliding_window"):
        raise ValueError(f"{', '.join(biases) or 'use_conv_bias=false / sliding_window'}: Nemotron-H here has no "
                         "projection biases, a convolution bias and full attention (as the released models).")
    limit = [float(x["__float__"]) if isinstance(x, dict) else float(x) for x in d.get("time_step_limit") or ()]
    if limit and limit != [0.0, float("inf")]:
        raise ValueError(f"time_step_limit={limit}: a clamped time step is not supported here.")
    types, mlps, moes = layers_of(blocks(d))
    heads, eos = int(get("num_attention_heads")), get("eos_token_id")
    moe = {}
    if any(moes):
        if d.get("moe_latent_size") is not None:
            raise ValueError(f"moe_latent_size={d['moe_latent_size']}: experts through a latent projection are not "
                             "supported here.")
        groups = (int(get("n_group")), int(get("topk_group")))
        moe = dict(num_experts=int(get("n_routed_experts")), num_experts_per_tok=int(get("num_experts_per_tok")),
                   moe_intermediate_size=int(get("moe_intermediate_size")), norm_topk_prob=bool(get("norm_topk_prob")),
                   shared_expert_size=int(get("moe_shared_expert_intermediate_size")), shared_expert_gated=False,
                   router_scoring="sigmoid", router_score_bias=True, router_groups=groups if groups[0] > 1 else None,
                   routed_scaling_factor=float(get("routed_scaling_factor")),
                   moe_layers=moes if sum(moes) < sum(mlps) else None)
    mamba = Mamba2(int(get("mamba_num_heads")), int(get("mamba_head_dim")), int(get("ssm_state_size")),
                   int(get("n_groups")), int(get("conv_kernel")))
    return cls(architecture=model_type, vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
               intermediate_size=int(get("intermediate_size")), num_layers=len(types), num_heads=heads,
               num_kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(get("head_dim")),
               rope_layers=(0,) * len(types), rms_norm_eps=float(get("layer_norm_epsilon")),
               tie_word_embeddings=bool(get("tie_word_embeddings")),
               max_position_embeddings=int(get("max_position_embeddings")), bos_token_id=get("bos_token_id"),
               eos_token_id=tuple(eos) if isinstance(eos, list) else eos, layer_types=types,
               mamba=mamba if "linear_attention" in types else None, mlp_layers=None if all(mlps) else mlps,
               **moe, dtype=dtype, param_dtype=param_dtype)


def check_hf(cfg: Any) -> None:
    """Refuses a config transformers' NemotronHForCausalLM would not load as it is."""
    if cfg.architecture not in HF_CLASSES:
        return
    require_fields(cfg, "Nemotron-H", "attention without position embeddings (no biases, q/k norm or windows), "
                   "Mamba-2 mixers and ungated MLPs", attention_bias=False, qk_norm=False, sliding_window=None,
                   rope_layers=(0,) * cfg.num_layers, rotary_dim=None, linear=None, short_conv=None, mla=None)
    if cfg.num_experts:
        require_fields(cfg, "Nemotron-H", "experts picked by sigmoid scores and a picking bias, beside a shared expert",
                       router_scoring="sigmoid", router_score_bias=True, shared_expert_gated=False, expert_bias=False)
        if not cfg.shared_expert_size:
            raise ValueError("HF Nemotron-H's experts blocks have a shared expert; set shared_expert_size.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a Nemotron-H config: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    kinds = []
    for i in range(cfg.num_layers):
        kinds += ["linear_attention" if cfg.layer_is_linear(i) else "full_attention"] + \
            (["moe" if cfg.layer_is_moe(i) else "mlp"] if cfg.layer_has_mlp(i) else [])
    m = cfg.mamba
    mamba = {} if m is None else dict(mamba_num_heads=m.heads, mamba_head_dim=m.head_dim, ssm_state_size=m.state,
                                      n_groups=m.groups, conv_kernel=m.conv_kernel, use_conv_bias=True)
    experts = {} if not cfg.num_experts else dict(
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.expert_size, moe_shared_expert_intermediate_size=cfg.shared_expert_size,
        n_shared_experts=1, norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=(cfg.router_groups or (1, 1))[0], topk_group=(cfg.router_groups or (1, 1))[1], moe_latent_size=None)
    skip = ("hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters", "num_hidden_layers")
    return hf_dict({k: v for k, v in common.items() if k not in skip}, **mamba, **experts, layers_block_type=kinds,
                   hybrid_override_pattern="".join(_PATTERN[k] for k in kinds),
                   num_hidden_layers=len(kinds), layer_norm_epsilon=cfg.rms_norm_eps, mlp_hidden_act="relu2",
                   mamba_hidden_act="silu", attention_bias=False, mlp_bias=False, use_bias=False,
                   residual_in_fp32=False, pad_token_id=None)


@functools.lru_cache(maxsize=8)
def first_blocks(cfg: Any) -> tuple[int, ...]:
    """Each of our layers' first block (its mixer's; its feed-forward's is the next)."""
    blocks = [1 + cfg.layer_has_mlp(i) for i in range(cfg.num_layers)]  # a layer's blocks: its mixer, its MLP
    return tuple(int(b) for b in np.cumsum([0] + blocks[:-1]))


def hf_name(name: str, cfg: Any) -> str:
    """Nemotron-H's name (as a checkpoint holds it: backbone.*) of a tensor the weight table names as Llama does
    (`hf_names.weight_entries`): layer i's norms, mixer and feed-forward are blocks b and b + 1 (`layers_of`)."""
    if name == "model.embed_tokens.weight":
        return "backbone.embeddings.weight"
    if name.startswith("model.norm."):
        return "backbone.norm_f." + name.removeprefix("model.norm.")
    found = _LAYER.match(name)
    if found is None:
        return name
    layer, part, rest = int(found.group(1)), found.group(2), found.group(3)
    block = first_blocks(cfg)[layer] + (part in ("post_attention_layernorm", "mlp"))
    if part in ("input_layernorm", "post_attention_layernorm"):
        return f"backbone.layers.{block}.norm.{rest}"
    return f"backbone.layers.{block}.mixer.{rest}"
