"""The families `hf_config` reads and writes through one shared path (Qwen2 / Qwen3 and their MoEs, Llama, InternLM3,
Mistral, Mixtral, Gemma 2 / 3, OLMo 2 / 3, OLMoE, SmolLM3, Phi-3, Granite, Granite MoE, Granite MoE Shared, Granite SWA
and Granite MoE SWA, gpt-oss, MiniMax-M2, GLM-4), each described by one `Family` row of `BASE`: what its transformers class does where they differ (which layers slide, the
default RoPE base, q/k norms, q/k/v biases, a partial rotary share, experts) and the config.json keys it writes of its
own. The families with modules of their own (`families.OWN_MODULES`) read and write themselves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from areal_jax.models import glm4, gpt_oss, granite_swa, minimax
from areal_jax.models.tensor_layout import LLAMA, Layout, block_sparse_moe


@dataclass(frozen=True)
class Family:
    """One family's row. windows: which layers a config.json's sliding_window applies to, as its class reads it:
    "none" (no sliding window), "every" (every layer when sliding_window is set), "flagged" (every layer when
    use_sliding_window is set), "from_layer" (with use_sliding_window, the layers layer_types names, by default those
    from max_window_layers on), "pattern" (all but every `period`-th layer; `period_key` overrides the period,
    `default_window` is the window where the file has none; full_first: by default the first layer of each period
    attends over everything, not the last). keep_window: the layer types also pick each layer's RoPE,
    so they are kept whatever the window (then `local_base(d, full_params)` is the sliding layers' own RoPE base).
    attention_bias: True (q/k/v biases always), None (q/k/v biases as attention_bias says, on by default), False (none;
    attention_bias=True, which would add an o_proj bias too, is refused). partial: a partial rotary share is read
    (`partial_default(d, head_dim)` where the file says none). experts: how its experts are read ("every": in every
    layer, of intermediate_size, renormalised; "olmoe": in every layer, of intermediate_size; "steps": Qwen-MoE's
    decoder_sparse_step / mlp_only_layers), or `fields(d)` reads its own ModelConfig fields; shared: the config.json
    key of a shared expert's width (none where it is 0) and whether a sigmoid gates it (Qwen2-MoE's) or it is added as
    it is (Granite MoE Shared's). sinks: a sink logit per head in every layer (Granite SWA's); layer_thetas: a RoPE base
per layer (`granite_swa.layer_thetas`). aliases: older key names read as others. layout and hf_name: how its checkpoints
store and name tensors (`hf_names.weight_entries`). write(cfg, d, shape): adds its own keys to
    config.json `d` (`shape`: see `Written`)."""

    hf_class: str
    write: Callable[[Any, dict, Any], None]
    model_type: str | None = None  # HF's model_type where it differs from the architecture's name
    windows: str = "none"
    period: int = 4
    period_key: str | None = None
    default_window: int = 4096
    full_first: bool = False
    keep_window: bool = False
    local_base: Callable[[dict, dict], float] | None = None
    default_theta: float = 10000.0
    qk_norm: bool = False
    attention_bias: bool | None = False
    partial: bool = False
    partial_default: Callable[[dict, int], float | None] | None = None
    gemma: bool = False
    softcaps: tuple[float, float] | None = None  # Gemma 2's defaults; other Gemmas refuse soft-capping
    experts: str | None = None
    shared: tuple[str, bool] | None = None  # a shared expert beside them: (the config.json key of its width, gated)
    fields: Callable[[dict], dict] | None = None
    granite: bool = False
    sinks: bool = False
    layer_thetas: bool = False
    no_rope_layers: bool = False  # SmolLM3's per-layer RoPE flags
    rope_interleave: bool = False
    longrope_aliases: bool = False  # Phi-3's older names of LongRoPE ("su", "yarn")
    defaults: dict | None = None  # keys a config.json may leave out, with transformers' values
    aliases: dict | None = None  # older key names transformers reads as others (InternLM3's qkv_bias: attention_bias)
    layout: Layout = LLAMA  # how its checkpoints store fused, stacked or moved tensors (`tensor_layout.Layout`)
    hf_name: Callable[[str], str] | None = None  # its tensor names from the weight table's (Llama's, Qwen3-MoE's)


@dataclass(frozen=True)
class Written:
    """What every writer may need besides the config: whether any layer slides, each layer's attention kind and the
    global layers' rope_parameters as hf_config wrote them."""

    sliding: bool
    types: list[str]
    rope_parameters: dict


def _window(cfg: Any, shape: Written) -> int | None:
    return cfg.sliding_window if shape.sliding else None


def _llama(cfg: Any, d: dict, shape: Written) -> None:
    d["mlp_bias"] = False


def _internlm3(cfg: Any, d: dict, shape: Written) -> None:
    d.update(mlp_bias=False, pad_token_id=None)  # (its default, 2, is a token id of its own vocabulary only)


def _nothing(cfg: Any, d: dict, shape: Written) -> None:
    return None


def _mistral(cfg: Any, d: dict, shape: Written) -> None:
    d["sliding_window"] = _window(cfg, shape)


def _mixtral(cfg: Any, d: dict, shape: Written) -> None:
    d.update(sliding_window=_window(cfg, shape), num_local_experts=cfg.num_experts,
             num_experts_per_tok=cfg.num_experts_per_tok, router_jitter_noise=0.0, output_router_logits=False)


def _granite(cfg: Any, d: dict, shape: Written) -> None:
    d.update(mlp_bias=False, embedding_multiplier=cfg.embedding_multiplier or 1.0,
             residual_multiplier=cfg.residual_multiplier or 1.0, logits_scaling=cfg.logits_scaling or 1.0,
             attention_multiplier=cfg.attention_multiplier or cfg.head_dim ** -0.5)


def _granite_moe(cfg: Any, d: dict, shape: Written) -> None:
    _granite(cfg, d, shape)
    d.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, output_router_logits=False)


def _granite_moe_shared(cfg: Any, d: dict, shape: Written) -> None:
    _granite_moe(cfg, d, shape)
    d["shared_intermediate_size"] = cfg.shared_expert_size or 0


def _granite_swa(cfg: Any, d: dict, shape: Written) -> None:
    _granite(cfg, d, shape)
    d.update(granite_swa.hf_keys(cfg, shape.types))


def _granite_moe_swa(cfg: Any, d: dict, shape: Written) -> None:
    _granite_moe_shared(cfg, d, shape)
    d.update(granite_swa.hf_keys(cfg, shape.types))


def _gpt_oss(cfg: Any, d: dict, shape: Written) -> None:
    d.update(gpt_oss.hf_dict(cfg, shape.sliding, shape.types))


def _partial_family(module: Any) -> Callable[[Any, dict, Written], None]:
    def write(cfg: Any, d: dict, shape: Written) -> None:
        d.update(module.hf_dict(cfg), **glm4.partial_rotary_keys(cfg, d))
    return write


def _olmoe(cfg: Any, d: dict, shape: Written) -> None:
    if cfg.expert_size != cfg.intermediate_size:
        raise ValueError("HF OLMoE's experts are of intermediate_size; set moe_intermediate_size=None.")
    d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
             norm_topk_prob=cfg.norm_topk_prob, clip_qkv=None, output_router_logits=False, pad_token_id=None)


def _qwen_window_keys(cfg: Any, d: dict, shape: Written) -> None:
    """Qwen's use_sliding_window, sliding_window, layer_types and max_window_layers (the first sliding layer)."""
    d.update(use_sliding_window=shape.sliding, sliding_window=_window(cfg, shape), layer_types=shape.types,
             max_window_layers=shape.types.index("sliding_attention") if shape.sliding else cfg.num_layers)


def _qwen_moe(cfg: Any, d: dict, shape: Written) -> None:
    dense = [i for i in range(cfg.num_layers) if not cfg.layer_is_moe(i)]
    d.update(use_sliding_window=shape.sliding, sliding_window=_window(cfg, shape), num_experts=cfg.num_experts,
             num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.expert_size,
             norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=dense,
             output_router_logits=False)


def _qwen2_moe(cfg: Any, d: dict, shape: Written) -> None:
    _qwen_moe(cfg, d, shape)
    _qwen_window_keys(cfg, d, shape)
    d.update(shared_expert_intermediate_size=cfg.shared_expert_size or 0, qkv_bias=True)


def _qwen(cfg: Any, d: dict, shape: Written) -> None:
    _qwen_window_keys(cfg, d, shape)


def _smollm3(cfg: Any, d: dict, shape: Written) -> None:
    d.update(no_rope_layers=list(cfg.rope_layers or (1,) * cfg.num_layers), mlp_bias=False,
             pad_token_id=None)  # its default (128004) lies outside a smaller vocabulary
    _qwen_window_keys(cfg, d, shape)


def _phi3(cfg: Any, d: dict, shape: Written) -> None:
    d.update(sliding_window=_window(cfg, shape), rope_scaling=None, **glm4.partial_rotary_keys(cfg, d),
             pad_token_id=None,  # its default (32000) lies outside a small vocabulary
             original_max_position_embeddings=int(shape.rope_parameters.get("original_max_position_embeddings",
                                                                            cfg.max_position_embeddings)))


def _scalar(cfg: Any) -> int | float:
    scalar = float(cfg.query_pre_attn_scalar or cfg.head_dim)
    return int(scalar) if scalar.is_integer() else scalar


def _gemma2(cfg: Any, d: dict, shape: Written) -> None:
    d.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=_scalar(cfg),
             sliding_window=cfg.sliding_window or cfg.max_position_embeddings, layer_types=shape.types,
             attn_logit_softcapping=cfg.attn_logit_softcap, final_logit_softcapping=cfg.final_logit_softcap)


def _per_kind_rope(cfg: Any, d: dict, shape: Written, local: dict) -> None:
    """Gemma 3's and OLMo 3's rope_parameters, one dictionary per layer kind (rope_scaling left out)."""
    d.pop("rope_scaling")
    d.update(sliding_window=cfg.sliding_window or cfg.max_position_embeddings, layer_types=shape.types,
             rope_parameters={"full_attention": shape.rope_parameters, "sliding_attention": local})


def _gemma3(cfg: Any, d: dict, shape: Written) -> None:
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta} if cfg.rope_local_theta is not None \
        else dict(shape.rope_parameters)
    _per_kind_rope(cfg, d, shape, local)
    d.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=_scalar(cfg),
             rope_local_base_freq=local["rope_theta"], attn_logit_softcapping=None, final_logit_softcapping=None)


def _olmo3(cfg: Any, d: dict, shape: Written) -> None:
    _per_kind_rope(cfg, d, shape, {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta})


# transformers' Gemma3TextConfig defaults: the image-and-text checkpoints' text_config lists only the keys that differ
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "bos_token_id": 2, "eos_token_id": 1}

# Granite SWA's and Granite MoE SWA's windows (every layer but each fourth, from the first), sinks and RoPE bases
_SWA = dict(windows="pattern", full_first=True, default_window=granite_swa.DEFAULT_WINDOW, keep_window=True,
            sinks=True, layer_thetas=True)

BASE: dict[str, Family] = {
    "qwen2": Family("Qwen2ForCausalLM", _qwen, windows="from_layer", attention_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", _qwen, windows="from_layer", qk_norm=True),
    "llama": Family("LlamaForCausalLM", _llama),
    # InternLM3 (internlm3-8b-instruct): transformers runs model type internlm3 as Llama's model and layer
    "internlm3": Family("LlamaForCausalLM", _internlm3, aliases={"qkv_bias": "attention_bias", "bias": "mlp_bias"},
                        defaults=dict(head_dim=128, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=32768,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "mistral": Family("MistralForCausalLM", _mistral, windows="every"),
    "gemma2": Family("Gemma2ForCausalLM", _gemma2, windows="pattern", period=2, gemma=True, softcaps=(50.0, 30.0)),
    "gemma3": Family("Gemma3ForCausalLM", _gemma3, model_type="gemma3_text", windows="pattern", period=6,
                     period_key="sliding_window_pattern", keep_window=True, default_theta=1e6, qk_norm=True, gemma=True,
                     local_base=lambda d, full: d.get("rope_local_base_freq", 10000.0), defaults=_GEMMA3_TEXT_DEFAULTS),
    "olmo2": Family("Olmo2ForCausalLM", _nothing, qk_norm=True),
    "olmo3": Family("Olmo3ForCausalLM", _olmo3, windows="pattern", keep_window=True, default_theta=5e5, qk_norm=True,
                    local_base=lambda d, full: full.get("rope_theta", d.get("rope_theta", 500_000.0))),
    "smollm3": Family("SmolLM3ForCausalLM", _smollm3, windows="from_layer", no_rope_layers=True),
    "phi3": Family("Phi3ForCausalLM", _phi3, windows="every", partial=True, longrope_aliases=True,
                   layout=Layout(qkv="fused", gate_up="fused")),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", _qwen_moe, windows="flagged", qk_norm=True, experts="steps"),
    "mixtral": Family("MixtralForCausalLM", _mixtral, windows="every", experts="every", hf_name=block_sparse_moe),
    "granite": Family("GraniteForCausalLM", _granite, granite=True),
    "granitemoe": Family("GraniteMoeForCausalLM", _granite_moe, granite=True, experts="every",
                         layout=Layout(experts="stacked")),
    "granitemoeshared": Family("GraniteMoeSharedForCausalLM", _granite_moe_shared, granite=True, experts="every",
                               shared=("shared_intermediate_size", False), layout=Layout(experts="stacked")),
    "granite_swa": Family("GraniteSWAForCausalLM", _granite_swa, granite=True, **_SWA),
    "granitemoe_swa": Family("GraniteMoeSWAForCausalLM", _granite_moe_swa, granite=True, experts="every",
                             shared=("shared_intermediate_size", False), layout=Layout(experts="stacked"),
                             hf_name=granite_swa.moe_hf_name, **_SWA),
    "olmoe": Family("OlmoeForCausalLM", _olmoe, qk_norm=True, experts="olmoe"),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", _qwen2_moe, windows="from_layer", attention_bias=True, experts="steps",
                        shared=("shared_expert_intermediate_size", True)),
    "gpt_oss": Family("GptOssForCausalLM", _gpt_oss, windows="pattern", period=2, default_window=128,
                      default_theta=1.5e5, attention_bias=None, fields=gpt_oss.hf_fields,
                      layout=Layout(experts="interleaved")),
    "minimax_m2": Family("MiniMaxM2ForCausalLM", _partial_family(minimax), default_theta=5e6, qk_norm=True,
                         partial=True, partial_default=minimax.partial_factor, fields=minimax.hf_fields,
                         layout=Layout(score_bias="beside"), hf_name=block_sparse_moe),
    "glm4": Family("Glm4ForCausalLM", _partial_family(glm4), attention_bias=None, partial=True,
                   partial_default=lambda d, head_dim: glm4.PARTIAL_ROTARY, rope_interleave=True,
                   layout=Layout(gate_up="fused"), hf_name=glm4.hf_name),
}


def hf_experts(d: dict, family: Family, model_type: str, num_layers: int) -> dict:
    """ModelConfig's mixture-of-experts fields of an HF config (none for the dense families): Qwen-MoE's experts in
    every decoder_sparse_step-th layer outside mlp_only_layers; Mixtral's and Granite MoE's in every layer, of
    intermediate_size, their weights always renormalised (Granite's softmax over the top-k logits); OLMoE's in every
    layer, of intermediate_size; a shared expert where the row has one and its width is not 0."""
    if family.fields is not None:
        return family.fields(d)
    if family.experts is None:
        return {}
    experts = d.get("num_experts", d.get("num_local_experts"))  # transformers writes Qwen3-MoE's as the latter
    if not experts or not d.get("num_experts_per_tok"):
        raise ValueError(f"HF config for {model_type} needs num_experts (or num_local_experts) and "
                         "num_experts_per_tok.")
    out = dict(num_experts=int(experts), num_experts_per_tok=int(d["num_experts_per_tok"]))
    width = int(d.get(family.shared[0]) or 0) if family.shared is not None else 0
    if width:
        out.update(shared_expert_size=width, shared_expert_gated=family.shared[1])
    if family.experts == "every":
        return {**out, "norm_topk_prob": True}
    if family.experts == "olmoe":
        return {**out, "norm_topk_prob": bool(d.get("norm_topk_prob", False))}
    step, dense_only = int(d.get("decoder_sparse_step", 1) or 1), set(d.get("mlp_only_layers") or ())
    flags = tuple(int(i not in dense_only and (i + 1) % step == 0) for i in range(num_layers))
    return {**out, "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "moe_intermediate_size": int(d.get("moe_intermediate_size") or d["intermediate_size"]),
            "moe_layers": None if all(flags) else flags}


def attention_layout(d: dict, family: Family, num_layers: int,
                     max_pos: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of an HF config, as its model class applies them (`Family.windows`). Outside the
    families whose layer types also pick each layer's RoPE, a window at least as long as the model's context is
    dropped (it would change nothing)."""
    window = d.get("sliding_window")
    if family.windows == "none" or (family.windows in ("flagged", "from_layer") and not d.get("use_sliding_window")):
        return None, None
    if family.windows in ("every", "flagged"):
        types = None
    elif family.windows == "from_layer":
        types = d.get("layer_types") or [
            "sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention"
            for i in range(num_layers)]
    else:  # pattern
        window = d.get("sliding_window", family.default_window)
        period = int(d.get(family.period_key, family.period)) if family.period_key else family.period
        types = d.get("layer_types") or [
            "sliding_attention" if (i + (not family.full_first)) % period else "full_attention" for i in range(num_layers)]
    types = tuple(types) if types is not None else None
    if family.keep_window:
        return int(window or max_pos), types
    if window is None or int(window) >= max_pos:
        return None, None
    if types is not None and "sliding_attention" not in types:
        return None, None
    return int(window), types


def check_hf(cfg: Any) -> None:
    """Refuses a config of one of `BASE`'s families that its transformers class would not load as it is (q/k norms,
    q/k/v biases, sliding windows, experts and RoPE bases its row does not have); the error names the fields."""
    family = BASE.get(cfg.architecture)
    if family is None:
        return
    arch = family.hf_class
    if family.attention_bias is not None and (cfg.qk_norm != family.qk_norm
                                              or cfg.attention_bias != family.attention_bias):
        have = f"{'' if family.qk_norm else 'no '}q/k norm and {'' if family.attention_bias else 'no '}q/k/v bias"
        raise ValueError(f"HF {arch} has {have}; set qk_norm={family.qk_norm}, attention_bias={family.attention_bias}.")
    sliding = any(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
    if sliding and family.windows == "none":
        sliders = ", ".join(a for a, f in BASE.items() if f.windows != "none")
        raise ValueError(f"HF {arch} has no sliding-window attention; set sliding_window=None or choose one of "
                         f"{sliders}.")
    if sliding and family.windows in ("every", "flagged") and cfg.layer_types is not None \
            and "full_attention" in cfg.layer_types:
        raise ValueError(f"HF {arch} slides every layer or none; set layer_types=None.")
    if family.experts in ("every", "olmoe") and cfg.moe_layers is not None:
        raise ValueError(f"HF {arch} has experts in every layer; set moe_layers=None.")
    if family.experts == "every" and (not cfg.norm_topk_prob or cfg.expert_size != cfg.intermediate_size):
        raise ValueError(f"HF {arch} has experts of intermediate_size in every layer and renormalises their weights; "
                         "set moe_layers=None, norm_topk_prob=True, moe_intermediate_size=None.")
    if family.sinks:
        granite_swa.check_hf(cfg, arch)
    if cfg.rope_local_theta is not None and family.local_base is None and not family.layer_thetas:
        raise ValueError(f"HF {arch} has one RoPE base for every layer; set rope_local_theta=None.")
    if cfg.rotary_dim is not None and not family.partial:
        raise ValueError(f"rotary_dim (partial rotary embeddings) is Phi's; HF {arch} rotates every dimension of a "
                         "head.")
    if cfg.shared_expert_size is not None and family.shared is None:
        raise ValueError(f"shared_expert_size (a shared expert) is Qwen2-MoE's and Granite MoE Shared's; HF {arch} has "
                         "none.")
    if cfg.shared_expert_size is not None and cfg.shared_expert_gated != family.shared[1]:
        raise ValueError(f"HF {arch}'s shared expert is {'gated by a sigmoid' if family.shared[1] else 'added ungated'}; "
                         f"set shared_expert_gated={family.shared[1]}.")
