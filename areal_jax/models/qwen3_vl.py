"""Qwen3-VL's text decoder (`Qwen3VLForConditionalGeneration`: Qwen3-VL-2B / 4B / 8B / 32B, Instruct and Thinking):
what its config.json means here (`text_config`).

The decoder is Qwen3's layer (per-head q/k RMSNorm, no biases). Its multimodal RoPE gives each position three
indices (time, height, width), each rotating the frequencies `mrope_section` assigns it (interleaved); a text token's
three indices are its position, so text rotates exactly as plain RoPE does, and text-only use reads the decoder as
Qwen3's. Image features added to the first layers' hidden states ("deepstack") only arrive with images. The decoder's
config sits under text_config and its weights under `model.language_model.` (the loader strips it); the vision tower
is never read, and saving writes a text-only Qwen3ForCausalLM. The mixture-of-experts models (Qwen3-VL-30B-A3B,
235B-A22B) keep their experts stacked in another layout on disk and are refused by name.
"""
from __future__ import annotations

from areal_jax.models.hf_family import text_decoder

WRAPPER = "qwen3_vl"  # Qwen3VLForConditionalGeneration's model_type: the text decoder under text_config
MOE_WRAPPER = "qwen3_vl_moe"
# transformers' Qwen3VLTextConfig, where a text_config leaves a key out (rope_theta: its default_theta)
_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                 max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=500000.0)
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def _plain_rope(rope: dict | None) -> dict | None:
    """A rope dictionary without its multimodal keys (which change nothing for text positions)."""
    return None if rope is None else {k: v for k, v in rope.items() if k not in _MROPE_KEYS}


def text_config(d: dict) -> tuple[dict, str]:
    """(Qwen3's config.json keys, "qwen3") of an image-and-text Qwen3-VL config: its text_config with transformers'
    defaults where it leaves a key out, the multimodal RoPE keys dropped, the outer file's special tokens where the
    inner one has none and the outer tie_word_embeddings (transformers' default: untied)."""
    if d.get("model_type") == MOE_WRAPPER:
        raise ValueError("model_type='qwen3_vl_moe' (Qwen3-VL's mixture-of-experts models) is not supported: their "
                         "experts are stacked on disk in a layout this loader does not read. The dense Qwen3-VL "
                         "checkpoints (model_type 'qwen3_vl') are.")
    text = text_decoder(d, "Qwen3VLForConditionalGeneration", "qwen3", tied=False)
    out = {**_DEFAULTS, **text}
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(out.get(key), dict):
            out[key] = _plain_rope(out[key])
            if out[key].get("rope_type", out[key].get("type", "default")) == "default":
                if "rope_theta" in out[key]:
                    out["rope_theta"] = out[key]["rope_theta"]
                out.pop(key)  # plain RoPE: only its base is left to say
    return out, "qwen3"
