"""Qwen3-VL's text decoder (`Qwen3VLForConditionalGeneration`: Qwen3-VL-2B / 4B / 8B / 32B, Instruct and Thinking):
what its config.json means here (`text_config`).

The decoder is Qwen3's layer (per-head q/k RMSNorm, no biases). Its multimodal RoPE gives each position three
indices (time, height, width), each rotating the frequencies `mrope_section` assigns it (interleaved); a text token's
three indices are its position, so text rotates exactly as plain RoPE does, and text-only use reads the decoder as
Qwen3's. Image features added to the first layers' hidden states ("deepstack") only arrive with images. The decoder's
config sits under text_config and its weights under `model.language_model.` (the loader strips it); the vision tower
is never read, and saving writes a text-only Qwen3ForCausalLM.

The mixture-of-experts models (`Qwen3VLMoeForConditionalGeneration`: Qwen3-VL-30B-A3B, 235B-A22B) are Qwen3-MoE's
decoder the same way: experts in every `decoder_sparse_step`-th layer outside `mlp_only_layers`, a softmax router
whose top `num_experts_per_tok` weights transformers always renormalises (whatever `norm_topk_prob` says), and the
experts stacked on disk (`models/stacked_experts.py` reads them as Qwen3-MoE's per-expert tensors); saving writes a
text-only Qwen3MoeForCausalLM.
"""
from __future__ import annotations

from areal_jax.models.hf_family import text_decoder

WRAPPER = "qwen3_vl"  # Qwen3VLForConditionalGeneration's model_type: the text decoder under text_config
MOE_WRAPPER = "qwen3_vl_moe"
# transformers' Qwen3VLTextConfig, where a text_config leaves a key out (rope_theta: its default_theta)
_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                 max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=500000.0)
# transformers' Qwen3VLMoeTextConfig's (head_dim: hidden_size / num_attention_heads)
_MOE_DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                     num_attention_heads=16, num_key_value_heads=16, hidden_act="silu", max_position_embeddings=128000,
                     rms_norm_eps=1e-6, rope_theta=500000.0, decoder_sparse_step=1, moe_intermediate_size=1408,
                     num_experts_per_tok=4, num_experts=60)
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def _plain_rope(rope: dict | None) -> dict | None:
    """A rope dictionary without its multimodal keys (which change nothing for text positions)."""
    return None if rope is None else {k: v for k, v in rope.items() if k not in _MROPE_KEYS}


def text_config(d: dict) -> tuple[dict, str]:
    """(Qwen3's or Qwen3-MoE's config.json keys, "qwen3" | "qwen3_moe") of an image-and-text Qwen3-VL config: its
    text_config with transformers' defaults where it leaves a key out, the multimodal RoPE keys dropped, the outer
    file's special tokens where the inner one has none and the outer tie_word_embeddings (transformers' default:
    untied)."""
    moe = d.get("model_type") == MOE_WRAPPER
    model_type = "qwen3_moe" if moe else "qwen3"
    text = text_decoder(d, f"Qwen3VL{'Moe' if moe else ''}ForConditionalGeneration", model_type, tied=False)
    if "num_local_experts" in text and "num_experts" not in text:  # transformers' alias of num_experts
        text["num_experts"] = text["num_local_experts"]
    out = {**(_MOE_DEFAULTS if moe else _DEFAULTS), **text}
    if moe:
        out["norm_topk_prob"] = True  # its router renormalises the top-k weights, whatever the file says
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(out.get(key), dict):
            out[key] = _plain_rope(out[key])
            if out[key].get("rope_type", out[key].get("type", "default")) == "default":
                if "rope_theta" in out[key]:
                    out["rope_theta"] = out[key]["rope_theta"]
                out.pop(key)  # plain RoPE: only its base is left to say
    return out, model_type
