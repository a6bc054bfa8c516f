"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: DeepSeek-V3, DeepSeek-R1, Kimi-K2, Moonlight), DeepSeek-V2
(`DeepseekV2ForCausalLM`: DeepSeek-V2, V2-Lite, DeepSeek-Coder-V2) and the GLM-4.5 family built on V3's mixture of
experts (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7; `Glm4MoeLiteForCausalLM`: GLM-4.7-Flash), and
dots.llm1 (`Dots1ForCausalLM`: Qwen3's attention, per-head q/k norms and sliding windows in the layers `layer_types`
names, by default those from max_window_layers on, before V3's experts): what their config.json means here
(`config_from_hf` / `config_to_hf`).

The layer: multi-head latent attention (`models.mla`; GLM-4.5's own layer instead has grouped-query attention with
q/k/v biases, optional q/k norm and RoPE on the first `partial_rotary_factor` of each head); the first
`first_k_dense_replace` layers with a dense MLP of intermediate_size (GLM-4.7-Flash: those `mlp_layer_types` calls
"dense"), the rest a mixture of experts of moe_intermediate_size plus `n_shared_experts` shared experts (one
MLP of n_shared_experts x moe_intermediate_size, ungated). DeepSeek-V3's router (GLM's too) scores each expert with a
sigmoid, adds `e_score_correction_bias` to pick (not to weigh), keeps the best `topk_group` of `n_group` groups (each
ranked by its two best scores), picks the top `num_experts_per_tok` there, renormalises their scores (`norm_topk_prob`)
and multiplies them by `routed_scaling_factor`; transformers' class does exactly that whatever the config's
`topk_method` / `scoring_func` say, so a config naming others is refused. DeepSeek-V2's router takes softmax
probabilities, picks the top k ("greedy"), or within the best topk_group groups ranked by their best probability
("group_limited_greedy"), and weighs them unrenormalised times routed_scaling_factor. On disk the experts are one
tensor per expert (mlp.experts.{j}.gate_proj ...), the router mlp.gate.weight (V3 and GLM: and
mlp.gate.e_score_correction_bias), the shared experts mlp.shared_experts.*; layers past num_hidden_layers (the
multi-token-prediction modules of V3 and GLM) are not read.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.config_checks import MLA
from areal_jax.models.glm4 import partial_rotary_keys
from areal_jax.models.hf_family import reader, rope_of

HF_CLASSES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
              "glm4_moe": "Glm4MoeForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM", "dots1": "Dots1ForCausalLM"}
LATENT = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")  # latent attention; glm4_moe and dots1: grouped-query
SIGMOID = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1")  # DeepSeek-V3's router
# transformers' config defaults, where a config.json leaves a key out
_DEFAULTS = {
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                        first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=0,
                        eos_token_id=1, topk_method="noaux_tc", rms_norm_eps=1e-6),
    "deepseek_v2": dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, moe_intermediate_size=1407,
                        num_hidden_layers=32, num_attention_heads=32, n_shared_experts=2, n_routed_experts=64,
                        routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        v_head_dim=128, qk_nope_head_dim=128, n_group=None, topk_group=None, num_experts_per_tok=None,
                        first_k_dense_replace=0, norm_topk_prob=False, max_position_embeddings=2048, bos_token_id=1,
                        eos_token_id=2, topk_method="greedy", rms_norm_eps=1e-6),
    "glm4_moe": dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                     num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, n_shared_experts=1,
                     n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1, num_experts_per_tok=8,
                     first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=131072, bos_token_id=None,
                     eos_token_id=None, rms_norm_eps=1e-5, partial_rotary_factor=0.5, use_qk_norm=False,
                     attention_bias=False),
    "glm4_moe_lite": dict(vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
                          num_hidden_layers=47, num_attention_heads=20, n_shared_experts=1, n_routed_experts=64,
                          routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
                          v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4,
                          norm_topk_prob=True, max_position_embeddings=202752, bos_token_id=0, eos_token_id=1,
                          rms_norm_eps=1e-5),
    "dots1": dict(vocab_size=152064, hidden_size=4608, intermediate_size=10944, moe_intermediate_size=1408,
                  num_hidden_layers=62, num_attention_heads=32, n_group=1, topk_group=1, first_k_dense_replace=0,
                  norm_topk_prob=False, max_position_embeddings=2048, rms_norm_eps=1e-6, routed_scaling_factor=1.0,
                  bos_token_id=None, eos_token_id=None, sliding_window=4096, max_window_layers=62)}


def _check_keys(d: dict, model_type: str) -> None:
    v3, deepseek = model_type == "deepseek_v3", model_type.startswith("deepseek")
    wanted = dict(hidden_act="silu")
    if deepseek:
        wanted.update(scoring_func="sigmoid" if v3 else "softmax", moe_layer_freq=1)
    if v3:
        wanted["topk_method"] = "noaux_tc"
    for key, value in wanted.items():
        if d.get(key, value) != value:
            raise ValueError(f"{key}={d[key]!r} is not {HF_CLASSES[model_type]}'s ({value!r}), which transformers "
                             "(and this project) runs; this checkpoint is another model.")
    if model_type == "deepseek_v2" and d.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method={d['topk_method']!r}: DeepSeek-V2 routes 'greedy' or 'group_limited_greedy'.")
    if model_type == "deepseek_v2" and d.get("norm_topk_prob"):
        raise ValueError("norm_topk_prob=True: transformers' DeepseekV2 never renormalises the routing weights, so "
                         "this checkpoint would run differently there; set it false.")
    if model_type == "dots1" and not (d.get("n_routed_experts") and d.get("num_experts_per_tok")):
        raise ValueError("dots1's config.json needs n_routed_experts and num_experts_per_tok (transformers' "
                         "Dots1Config has no default for them).")
    if d.get("attention_bias") and model_type in LATENT:
        raise ValueError(f"attention_bias=True is not supported for {model_type} (its released checkpoints have none).")


def _dense_flags(d: dict, model_type: str, layers: int, get: Any) -> tuple[int, ...] | None:
    """moe_layers of a config: GLM-4.7-Flash's `mlp_layer_types` ("dense" / "sparse" per layer; by default the first
    dense), elsewhere the first `first_k_dense_replace` layers dense; None when every layer has experts."""
    if model_type == "glm4_moe_lite":
        types = d.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        if len(types) != layers or set(types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} layers; got "
                             f"{types!r}.")
        flags = tuple(int(t == "sparse") for t in types)
    else:
        dense = int(get("first_k_dense_replace") or 0)
        flags = tuple(int(i >= dense) for i in range(layers))
    return None if all(flags) else flags


def config_from_hf(cls: type, d: dict, model_type: str, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32) -> Any:
    """A ModelConfig of a config.json of one of `HF_CLASSES`' model types (transformers' config defaults where a
    key is absent)."""
    _check_keys(d, model_type)
    defaults, latent = _DEFAULTS[model_type], model_type in LATENT

    get = reader(d, defaults)

    layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
    rope, _ = rope_of(d)
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", get("partial_rotary_factor") or 1.0) or 1.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if latent:
        mla = MLA(None if get("q_lora_rank") is None else int(get("q_lora_rank")), int(get("kv_lora_rank")),
                  int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim")), int(get("v_head_dim")),
                  bool(d.get("rope_interleave", True)) if model_type != "deepseek_v2" else True)  # V2: complex pairs
        attention = dict(mla=mla, num_kv_heads=heads, head_dim=mla.nope + mla.rope)
    else:  # GLM-4.5: grouped-query attention, RoPE on the first partial_rotary_factor of each head
        head_dim = int(d.get("head_dim") or int(get("hidden_size")) // heads)
        attention = dict(num_kv_heads=int(get("num_key_value_heads") or heads), head_dim=head_dim,
                         attention_bias=bool(get("attention_bias")),
                         qk_norm=model_type == "dots1" or bool(get("use_qk_norm")),  # (dots1: always)
                         rotary_dim=int(head_dim * partial) if partial != 1.0 else None, **_windows(d, model_type, layers, get))
    sigmoid = model_type in SIGMOID
    experts = router_fields(get, "n_routed_experts", "n_shared_experts", sigmoid,
                            grouped=sigmoid or get("topk_method") == "group_limited_greedy")
    eos = get("eos_token_id")
    return cls(
        architecture=model_type, vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")), num_layers=layers, num_heads=heads, **attention,
        rope_theta=theta, rope_scaling=None if rope_type == "default" else rope,
        rms_norm_eps=float(get("rms_norm_eps")), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(get("max_position_embeddings")), bos_token_id=get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos, **experts,
        moe_layers=_dense_flags(d, model_type, layers, get), dtype=dtype, param_dtype=param_dtype)


def _windows(d: dict, model_type: str, layers: int, get: Any) -> dict:
    """dots1's sliding windows (sliding_window, layer_types): in the layers `layer_types` names, by default those from
    max_window_layers on where sliding_window is set; none where no layer slides (or for the other families)."""
    if model_type != "dots1" or get("sliding_window") is None:
        return {}
    types = d.get("layer_types") or ["sliding_attention" if i >= int(get("max_window_layers")) else "full_attention"
                                     for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name 'full_attention' or 'sliding_attention' for each of the {layers} "
                         f"layers; got {types!r}.")
    if "sliding_attention" not in types or int(get("sliding_window")) >= int(get("max_position_embeddings")):
        return {}
    return dict(sliding_window=int(get("sliding_window")), layer_types=tuple(types))


def router_fields(get: Any, experts: str, shared: str, sigmoid: bool, grouped: bool) -> dict:
    """The ModelConfig fields of DeepSeek-V3's experts and router from a config.json (`get(key)`: its value, or the
    family's default), whose routed and shared expert counts are under the keys `experts` and `shared` (EXAONE MoE
    names them otherwise): experts of moe_intermediate_size, shared ones of that width each, ungated; sigmoid scores
    with a picking bias (else softmax); with `grouped`, the best topk_group of n_group groups (none for one group)."""
    width, groups = int(get("moe_intermediate_size")), (int(get("n_group") or 1), int(get("topk_group") or 1))
    return dict(num_experts=int(get(experts)), num_experts_per_tok=int(get("num_experts_per_tok") or 0),
                moe_intermediate_size=width, norm_topk_prob=bool(get("norm_topk_prob")),
                shared_expert_size=width * int(get(shared) or 0) or None, shared_expert_gated=False,
                router_scoring="sigmoid" if sigmoid else "softmax",
                router_groups=groups if grouped and groups[0] > 1 else None, router_score_bias=sigmoid,
                routed_scaling_factor=float(get("routed_scaling_factor")))


def check_hf(cfg: Any) -> None:
    """Refuses a config that transformers' class of its model type (or, for DeepSeek's own fields, any other family)
    would not load as it is; the error names the fields to change."""
    own = dict(mla=cfg.mla is not None, router_scoring=cfg.router_scoring == "sigmoid",  # (PhiMoE's: models/phimoe.py)
               router_groups=cfg.router_groups is not None, router_score_bias=cfg.router_score_bias,
               routed_scaling_factor=cfg.routed_scaling_factor != 1.0, shared_expert_gated=not cfg.shared_expert_gated)
    arch = cfg.architecture
    if arch not in HF_CLASSES:  # MiniMax-M2's and ERNIE's routers have picking biases (their modules check them)
        theirs = {"minimax_m2": ("router_scoring", "router_score_bias"),
                  "ernie4_5_moe": ("router_score_bias", "shared_expert_gated"),
                  "exaone_moe": tuple(own),  # EXAONE MoE: V3's router (models/exaone.py checks it)
                  "nemotron_h": tuple(own)[1:],  # Nemotron-H's experts blocks: V3's router (models/nemotron_h.py)
                  "hunyuan_v1_moe": ("shared_expert_gated",), "granitemoehybrid": ("shared_expert_gated",),
                  "granitemoeshared": ("shared_expert_gated",), "granitemoe_swa": ("shared_expert_gated",),
                  "youtu": ("mla",),  # Youtu-LLM: V3's latent attention (models/youtu.py checks it)
                  "lfm2_moe": ("router_scoring", "router_score_bias", "routed_scaling_factor")}.get(arch, ())
        used = [k for k, v in own.items() if v and k not in theirs]
        if used:
            raise ValueError(f"{', '.join(used)} are DeepSeek's; HF {arch} has none. Leave them at "
                             "their defaults or use architecture='deepseek_v3'.")
        return
    latent = arch in LATENT
    if (cfg.mla is not None) != latent or cfg.shared_expert_gated:
        raise ValueError(f"HF {arch} has {'latent' if latent else 'grouped-query'} attention and ungated shared "
                         f"experts; set mla{'' if latent else '=None'} and shared_expert_gated=False.")
    if arch in SIGMOID and (cfg.router_scoring != "sigmoid" or not cfg.router_score_bias):
        raise ValueError(f"HF {arch} has a sigmoid router with a picking bias; set router_scoring='sigmoid', "
                         "router_score_bias=True.")
    if arch == "deepseek_v2" and (cfg.router_scoring != "softmax" or cfg.router_score_bias
                                  or cfg.norm_topk_prob or not cfg.mla.interleave):
        raise ValueError("HF DeepSeek-V2 has a softmax router without a picking bias or renormalised weights, and "
                         "interleaved rotary pairs; set router_scoring='softmax', router_score_bias=False, "
                         "norm_topk_prob=False, mla.interleave=True.")
    moe = [cfg.layer_is_moe(i) for i in range(cfg.num_layers)]
    first = moe.index(True) if True in moe else cfg.num_layers
    dense_first = arch == "glm4_moe_lite" or all(moe[first:])  # GLM-4.7-Flash lists each layer's kind
    if arch == "dots1" and (not cfg.qk_norm or cfg.rotary_dim is not None):
        raise ValueError("HF Dots1 has per-head q/k norms and rotates every dimension; set qk_norm=True, "
                         "rotary_dim=None.")
    if not dense_first or (cfg.sliding_window is not None and arch != "dots1") or cfg.rope_local_theta is not None:
        raise ValueError(f"HF {arch} has dense layers first, experts in every layer after them, no "
                         "sliding window and one RoPE base; set moe_layers accordingly, sliding_window=None, "
                         "rope_local_theta=None.")
    if cfg.shared_expert_size is not None and cfg.shared_expert_size % cfg.expert_size:
        raise ValueError(f"HF {arch}'s shared experts are n_shared_experts x moe_intermediate_size wide; "
                         f"shared_expert_size={cfg.shared_expert_size} is not a multiple of {cfg.expert_size}.")


def config_to_hf(cfg: Any, common: dict) -> dict:
    """The config.json of a config of `HF_CLASSES`: `common` (hf_config's keys every family writes) with its own."""
    check_hf(cfg)
    arch, m, moe = cfg.architecture, cfg.mla, [cfg.layer_is_moe(i) for i in range(cfg.num_layers)]
    (n_group, topk_group), latent = cfg.router_groups or (1, 1), arch in LATENT
    drop = ("layer_types", "sliding_window", *(("head_dim",) if latent else ()))  # GLM-4.7-Flash: an alias of rope's
    d = {k: v for k, v in common.items() if k not in drop}
    d.update(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
             moe_intermediate_size=cfg.expert_size, n_shared_experts=(cfg.shared_expert_size or 0) // cfg.expert_size,
             n_group=n_group, topk_group=topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
             norm_topk_prob=cfg.norm_topk_prob, attention_bias=cfg.attention_bias, pad_token_id=None)
    if latent:
        d.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.nope,
                 qk_rope_head_dim=m.rope, v_head_dim=m.v)
    first_dense = moe.index(True) if True in moe else cfg.num_layers
    if arch.startswith("deepseek"):
        v3 = arch == "deepseek_v3"
        d.update(first_k_dense_replace=first_dense, moe_layer_freq=1, scoring_func="sigmoid" if v3 else "softmax",
                 topk_method="noaux_tc" if v3 else "group_limited_greedy" if cfg.router_groups else "greedy")
    if arch in ("deepseek_v3", "glm4_moe_lite"):
        d["rope_interleave"] = m.interleave
    if arch in ("deepseek_v3", "glm4_moe"):
        d["num_nextn_predict_layers"] = 0  # the multi-token-prediction module is not kept
    if arch == "glm4_moe":
        d.update(first_k_dense_replace=first_dense, use_qk_norm=cfg.qk_norm, **partial_rotary_keys(cfg, d))
    if arch == "glm4_moe_lite":
        d["mlp_layer_types"] = ["sparse" if f else "dense" for f in moe]
    if arch == "dots1":
        types = ["sliding_attention" if cfg.layer_window(i) is not None else "full_attention"
                 for i in range(cfg.num_layers)]
        d.update(first_k_dense_replace=first_dense, sliding_window=cfg.sliding_window, layer_types=types,
                 max_window_layers=types.index("sliding_attention") if "sliding_attention" in types else cfg.num_layers)
    return d
