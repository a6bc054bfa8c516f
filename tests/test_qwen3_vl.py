"""Qwen3-VL's text decoder (models/qwen3_vl.py): an image-and-text Qwen3VLForConditionalGeneration checkpoint loads as
Qwen3's decoder.

References: transformers' Qwen3VLForConditionalGeneration on text tokens (its multimodal RoPE, interleaved sections,
with a vision tower and deepstack layers on disk), transformers' Qwen3VLTextConfig defaults, and transformers'
Qwen3ForCausalLM reading what we save.
"""
from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import random_tokens

pytestmark = pytest.mark.parity
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=1,
              temporal_patch_size=1, num_position_embeddings=16, deepstack_visual_indexes=[0])


def _vl_checkpoint(path, cfg: ModelConfig, tied: bool):
    """transformers' Qwen3-VL with `cfg` as its text decoder (multimodal RoPE sections over the head's frequencies),
    random weights, saved to `path`; returns the torch model."""
    import transformers

    from areal_jax.testing.hf import randomize_torch

    text = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "tie_word_embeddings")}
    half = cfg.head_dim // 2
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                               "mrope_section": [half - 2 * (half // 4), half // 4, half // 4],
                               "mrope_interleaved": True}
    config = transformers.Qwen3VLConfig(text_config=text, vision_config={**VISION, "out_hidden_size": cfg.hidden_size},
                                        tie_word_embeddings=tied)
    hf = randomize_torch(transformers.Qwen3VLForConditionalGeneration(config).eval(), seed=4)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_an_image_and_text_checkpoint_loads_its_text_decoder(tmp_path, tied):
    """Text-only logits equal transformers' Qwen3-VL's (its three RoPE indices equal for text tokens), the vision tower
    and deepstack mergers stay on disk, and the outer file's tie_word_embeddings decides the output matrix."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint

    cfg = dataclasses.replace(testing.tiny_config("qwen3", rope_theta=1000.0), tie_word_embeddings=tied)
    hf = _vl_checkpoint(tmp_path, cfg, tied)
    from safetensors import safe_open

    names = []
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as fh:
            names += list(fh.keys())
    assert any(n.startswith("model.visual.") for n in names)  # a real image-and-text checkpoint
    assert all(n.startswith(("model.visual.", "model.language_model.", "lm_head.")) for n in names)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.cfg == cfg
    tokens = random_tokens(cfg.vocab_size, (2, 40), seed=2)  # text tokens only: no image placeholders
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), want, atol=1e-4, rtol=0)

    # What we save is Qwen3ForCausalLM, which transformers reads with the same text logits.
    import transformers

    from areal_jax.models import save_hf_checkpoint

    out = tmp_path / "saved"
    save_hf_checkpoint(ours, out)
    with open(out / "config.json") as fh:
        assert json.load(fh)["architectures"] == ["Qwen3ForCausalLM"]
    text_only = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        again = text_only(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(again, want, atol=1e-4, rtol=0)


def test_the_config_reads_transformers_defaults_and_refuses_the_experts():
    """A text_config that leaves keys out takes transformers' Qwen3VLTextConfig defaults (the released files list
    them all, but nothing requires it); the mixture-of-experts wrapper is refused by name."""
    transformers = pytest.importorskip("transformers", reason="the defaults are transformers'")
    full = transformers.Qwen3VLConfig(text_config={"num_hidden_layers": 3}).to_dict()
    sparse = {"model_type": "qwen3_vl", "text_config": {"num_hidden_layers": 3}}
    want, got = ModelConfig.from_hf_dict(full), ModelConfig.from_hf_dict(sparse)
    assert got == want
    text = full["text_config"]
    assert (got.architecture, got.vocab_size, got.hidden_size, got.num_kv_heads, got.head_dim) == (
        "qwen3", text["vocab_size"], text["hidden_size"], text["num_key_value_heads"], text["head_dim"])
    assert got.rope_theta == text["rope_parameters"]["rope_theta"] and not got.tie_word_embeddings
    with pytest.raises(ValueError, match="qwen3_vl_moe"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_vl_moe", "text_config": {}})
