"""What `hf_config.config_to_hf` refuses before writing a config.json: a ModelConfig that its family's transformers
class would not load as it is (a field that family lacks, or lacks a value it always has); each error names the
fields to change."""
from __future__ import annotations

from typing import Any

from areal_jax.models import base_families, deepseek, glm4, gpt_oss, minimax, qwen3_5
from areal_jax.models.families import OWN_MODULES

GRANITE_SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def check_loadable(cfg: Any) -> None:
    """Raises a ValueError naming the fields to change where transformers' class of `cfg.architecture` would not load
    `cfg` as it is (the families with modules of their own check their own fields: `families.OWN_MODULES`)."""
    for family in (gpt_oss, minimax, glm4, *OWN_MODULES, base_families):
        family.check_hf(cfg)
    if cfg.attention_sinks and cfg.architecture != "gpt_oss" and not getattr(base_families.BASE.get(cfg.architecture),
                                                                              "sinks", False):
        raise ValueError(f"attention_sinks are gpt-oss's and Granite SWA's; HF {cfg.architecture} has none. Turn them "
                         "off or use architecture='gpt_oss'.")
    if cfg.architecture == "granitemoehybrid" and (cfg.attention_bias or cfg.qk_norm):
        raise ValueError("HF Granitemoehybrid has no q/k/v bias and no q/k norm; set attention_bias=False, "
                         "qk_norm=False.")
    if cfg.olmo and (cfg.attention_bias or not cfg.qk_norm):
        raise ValueError(f"HF {cfg.architecture} has q/k norm and no q/k/v bias; set qk_norm=True, "
                         "attention_bias=False.")
    if (cfg.attn_logit_softcap is not None or cfg.final_logit_softcap is not None) and \
            cfg.architecture not in ("gemma2", "nanochat"):
        raise ValueError(f"logit soft-capping is Gemma 2's (and NanoChat's, of the logits); HF {cfg.architecture} has "
                         "none.")
    sliding = any(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
    granite = cfg.architecture == "granitemoehybrid" or getattr(base_families.BASE.get(cfg.architecture), "granite", False)
    own = GRANITE_SCALARS[1:] if cfg.architecture == "falcon_h1" else GRANITE_SCALARS[:3] if cfg.parallel_block \
        else GRANITE_SCALARS  # (Falcon-H1's embeddings', Cohere's logit_scale)
    if not granite and any(getattr(cfg, k) is not None for k in own):
        raise ValueError(f"{', '.join(own)} are Granite's; HF {cfg.architecture} has none.")
    falcon = cfg.architecture == "falcon_h1"
    if not falcon and (cfg.hybrid_scales is not None or "hybrid" in (cfg.layer_types or ())):
        raise ValueError(f"hybrid layers (attention and Mamba-2 side by side) and hybrid_scales (their multipliers) are "
                         f"Falcon-H1's; HF {cfg.architecture} has neither.")
    if cfg.mamba1 is not None and cfg.architecture not in ("jamba", "mamba", "falcon_mamba"):
        raise ValueError(f"mamba1 (Mamba mixers) is Jamba's, Mamba's and Falcon-Mamba's; HF {cfg.architecture} has "
                         "none.")
    if not falcon and cfg.mamba is not None and cfg.mamba.norm != "after_gate":
        raise ValueError(f"HF {cfg.architecture}'s Mamba-2 mixers normalise their output after the gate; set "
                         "mamba's norm='after_gate'.")
    if sliding and cfg.architecture == "granitemoehybrid":
        raise ValueError("HF Granite has no sliding-window attention; set sliding_window=None.")
    if cfg.shared_expert_size is not None and cfg.architecture not in (*base_families.BASE, "ernie4_5_moe", "qwen3_5_moe_text", "qwen3_next",
                                                                       "exaone_moe", "hunyuan_v1_moe", "granitemoehybrid", "nemotron_h",
                                                                       *deepseek.HF_CLASSES):
        raise ValueError(f"shared_expert_size (a shared expert) is Qwen2-MoE's; HF {cfg.architecture} has none.")
    if cfg.rope_local_theta is not None and cfg.architecture not in (*base_families.BASE, "lfm3"):
        raise ValueError(f"rope_local_theta (a RoPE base of its own for sliding layers) is Gemma 3's, OLMo 3's and "
                         f"LFM3's; HF {cfg.architecture} has one base for every layer.")
    if cfg.rope_layers is not None and cfg.architecture not in ("smollm3", "exaone4", "exaone_moe", "granitemoehybrid",
                                                                "nemotron_h", "jamba", "cohere2", "granite_swa",
                                                                "granitemoe_swa"):
        raise ValueError(f"rope_layers (layers without rotary embeddings) is SmolLM3's, EXAONE's, Granite 4.0's, Granite "
                         f"SWA's and Nemotron-H's; HF {cfg.architecture} rotates in every layer.")
    if cfg.residual_in_fp32 and cfg.architecture not in ("mamba", "falcon_mamba", "mamba2"):
        raise ValueError(f"residual_in_fp32 (a float32 residual stream) is Mamba's, Falcon-Mamba's and Mamba-2's; HF "
                         f"{cfg.architecture} keeps it in the compute dtype.")
    if cfg.mlp_layers is not None and cfg.architecture not in ("nemotron_h", "mamba", "falcon_mamba", "mamba2"):
        raise ValueError(f"mlp_layers (layers without a feed-forward) is Nemotron-H's; HF {cfg.architecture} has one "
                         "in every layer.")
    if cfg.rotary_dim is not None and cfg.architecture not in (*base_families.BASE, "glm4_moe", "bamba",
                                                               "gpt_neox", "phi", "glm", "stablelm", "nemotron",
                                                               *qwen3_5.HF_CLASSES):
        raise ValueError(f"rotary_dim (partial rotary embeddings) is Phi's; HF {cfg.architecture} rotates every "
                         "dimension of a head.")
    if cfg.query_pre_attn_scalar is not None and not cfg.gemma:
        raise ValueError(f"query_pre_attn_scalar is Gemma 3's; HF {cfg.architecture} scales attention by "
                         "head_dim ** -0.5.")
