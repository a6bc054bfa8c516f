"""Qwen3-VL's text decoder (models/qwen3_vl.py, models/stacked_experts.py): an image-and-text
Qwen3VLForConditionalGeneration checkpoint loads as Qwen3's decoder, a Qwen3VLMoeForConditionalGeneration one as
Qwen3-MoE's.

References: transformers' classes on text tokens (their multimodal RoPE, interleaved sections, with a vision tower and
deepstack layers on disk; the MoE's stacked experts as transformers' own loader reads them), transformers' text config
defaults, and transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM reading what we save.
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


def _tiny(arch: str, tied: bool = False) -> ModelConfig:
    """The tiny qwen3 / qwen3_moe config these tests wrap (experts 24 wide, so that no axis of theirs is square)."""
    cfg = dataclasses.replace(testing.tiny_config(arch, rope_theta=1000.0), tie_word_embeddings=tied)
    return dataclasses.replace(cfg, moe_intermediate_size=24) if arch == "qwen3_moe" else cfg


def _vl_checkpoint(path, cfg: ModelConfig, tied: bool):
    """transformers' Qwen3-VL (Qwen3-VL-MoE for a qwen3_moe `cfg`) with `cfg` as its text decoder (multimodal RoPE
    sections over the head's frequencies), random weights, saved to `path`; returns the torch model."""
    import torch
    import transformers

    from areal_jax.testing.hf import randomize_torch

    text = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "tie_word_embeddings")}
    half = cfg.head_dim // 2
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                               "mrope_section": [half - 2 * (half // 4), half // 4, half // 4],
                               "mrope_interleaved": True}
    moe = cfg.architecture == "qwen3_moe"
    config = (transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig)(
        text_config=text, vision_config={**VISION, "out_hidden_size": cfg.hidden_size}, tie_word_embeddings=tied)
    model = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    hf = randomize_torch(model(config).eval(), seed=4)
    if not moe:
        hf.save_pretrained(path)
        return hf
    # transformers 5.25's save_pretrained fails on this class's reverse expert conversion; write its on-disk layout
    # by hand (experts [E, in, out]: gate_up_proj [E, D, 2F], down_proj [E, F, D]), checked below by its own loader.
    from safetensors.torch import save_file

    tensors = {}
    for name, value in hf.state_dict().items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            value = value.transpose(1, 2)  # in memory [E, out, in]
        if not (tied and name == "lm_head.weight"):
            tensors[name] = value.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    back = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.tensor(np.asarray(random_tokens(cfg.vocab_size, (1, 12), seed=9)))
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, hf(input_ids=tokens).logits)  # the layout is transformers'
    return hf


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("qwen3", True), ("qwen3_moe", False)])
def test_an_image_and_text_checkpoint_loads_its_text_decoder(tmp_path, arch, tied):
    """Text-only logits equal transformers' Qwen3-VL's (its three RoPE indices equal for text tokens), the vision tower
    and deepstack mergers stay on disk, and the outer file's tie_word_embeddings decides the output matrix; the MoE's
    stacked experts read as Qwen3-MoE's per-expert tensors."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint

    cfg = _tiny(arch, tied)
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
        assert json.load(fh)["architectures"] == ["Qwen3MoeForCausalLM" if arch == "qwen3_moe" else "Qwen3ForCausalLM"]
    text_only = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        again = text_only(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(again, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("wrapper", ["qwen3_vl", "qwen3_vl_moe"])
def test_the_config_reads_transformers_defaults(wrapper):
    """A text_config that leaves keys out takes transformers' text config defaults (the released files list them
    all, but nothing requires it); the MoE's router renormalises its top-k weights even where the file says not."""
    transformers = pytest.importorskip("transformers", reason="the defaults are transformers'")
    cls = transformers.Qwen3VLMoeConfig if wrapper == "qwen3_vl_moe" else transformers.Qwen3VLConfig
    full = cls(text_config={"num_hidden_layers": 3}).to_dict()
    sparse = {"model_type": wrapper, "text_config": {"num_hidden_layers": 3}}
    want, got = ModelConfig.from_hf_dict(full), ModelConfig.from_hf_dict(sparse)
    assert got == want
    text = full["text_config"]
    assert (got.vocab_size, got.hidden_size, got.num_kv_heads, got.head_dim) == (
        text["vocab_size"], text["hidden_size"], text["num_key_value_heads"],
        text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    assert got.rope_theta == text["rope_parameters"]["rope_theta"] and not got.tie_word_embeddings
    if wrapper == "qwen3_vl":
        assert got.architecture == "qwen3"
        return
    assert (got.architecture, got.num_experts, got.num_experts_per_tok, got.moe_intermediate_size) == (
        "qwen3_moe", text.get("num_experts", text.get("num_local_experts")), text["num_experts_per_tok"], text["moe_intermediate_size"])
    said_not = ModelConfig.from_hf_dict({**sparse, "text_config": {"norm_topk_prob": False}})
    assert got.norm_topk_prob and said_not.norm_topk_prob


@pytest.mark.parametrize("arch,targets", [("qwen3", "all"), ("qwen3_moe", "attn,experts")])
def test_peft_adapters_over_the_image_and_text_model(tmp_path, arch, targets):
    """Adapters exported over a Qwen3-VL base are named where transformers holds its decoder
    (model.language_model.layers): peft applies them to the image-and-text model with our logits, and they read back
    into ours unchanged."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from flax import nnx

    from areal_jax.models import load_hf_checkpoint, lora
    from areal_jax.models.peft_io import save_peft_adapter
    from areal_jax.testing.hf import assert_peft_round_trip, randomize_lora_b

    cfg, base = _tiny(arch), tmp_path / "base"
    _vl_checkpoint(base, cfg, tied=False)
    model = load_hf_checkpoint(base)
    lcfg = lora.LoRAConfig(rank=4, alpha=12.0, targets=targets)
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(1))
    randomize_lora_b(model, 0.2)
    out = save_peft_adapter(model, lcfg, tmp_path / "adapter", base_model_name_or_path=str(base))
    with open(tmp_path / "adapter" / "adapter_config.json") as fh:
        config = json.load(fh)
    assert all("language_model" in p for p in config.get("target_parameters") or ["model.language_model."])
    assert_peft_round_trip(out, base, model, lcfg, random_tokens(cfg.vocab_size, (2, 24), seed=5),
                           hf_class="AutoModelForImageTextToText")

@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_the_trained_decoder_goes_back_into_the_image_and_text_checkpoint(tmp_path, arch):
    """models.wrapped_export.rewrap: a changed decoder, saved text-only, written back under the source's names (the
    MoE's experts stacked again): transformers' image-and-text class loads it with our logits, the vision tower's
    tensors are the source's byte for byte, and the config and processor files are the source's."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    import jax
    from flax import nnx
    from safetensors.numpy import load_file

    from areal_jax.models import load_hf_checkpoint, save_hf_checkpoint
    from areal_jax.models.wrapped_export import rewrap

    cfg, base = _tiny(arch), tmp_path / "base"
    _vl_checkpoint(base, cfg, tied=False)
    (base / "preprocessor_config.json").write_text('{"size": 4}')
    model = load_hf_checkpoint(base)
    params = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(params))))
    nnx.update(model, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), params))
    save_hf_checkpoint(model, tmp_path / "decoder")
    copied = rewrap(tmp_path / "decoder", base, tmp_path / "out")

    source, out = load_file(str(base / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(out) == sorted(source)  # every source tensor, under its own name
    assert copied and all(n.startswith("model.visual.") for n in copied)
    assert sorted(copied) == sorted(n for n in source if n.startswith("model.visual."))
    for n in copied:
        np.testing.assert_array_equal(out[n], source[n])
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    assert (tmp_path / "out" / "preprocessor_config.json").read_text() == '{"size": 4}'
    tokens = random_tokens(cfg.vocab_size, (2, 24), seed=6)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
    want = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="not an image-and-text checkpoint"):
        rewrap(tmp_path / "decoder", tmp_path / "decoder", tmp_path / "again")
    # the same from the tensors in memory (a HostCheckpoint's), without the text-only directory
    from areal_jax.models.hf_io import read_safetensors_dir

    assert rewrap(read_safetensors_dir(tmp_path / "decoder"), base, tmp_path / "held") == copied
    held = load_file(str(tmp_path / "held" / "model.safetensors"))
    assert sorted(held) == sorted(out) and all(np.array_equal(held[n], out[n]) for n in out)
    # and from the model itself, each tensor fetched as it is written, in shards of ~20 kB (the MoE's experts stacked
    # from slices of three parameters in turn)
    assert rewrap(model, base, tmp_path / "live", 20_000) == copied
    assert len(list((tmp_path / "live").glob("model-*.safetensors"))) > 2
    live = read_safetensors_dir(tmp_path / "live")
    assert sorted(live) == sorted(out) and all(np.array_equal(live[n], out[n]) for n in out)
    assert (tmp_path / "live" / "preprocessor_config.json").exists()
    rewrap(model, base, tmp_path / "other", writer=False)  # another process of a multi-process run: gathers only
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("short_of_memory", [False, True])
def test_the_runs_periodic_exports_are_the_image_and_text_checkpoint(tmp_path, monkeypatch, short_of_memory):
    """HFExporter with the run's source (as the job passes model.path): RUN/hf/step_N is the image-and-text checkpoint
    with the decoder of that step, loaded by transformers' class with our logits, the tokenizer beside it; written
    from the host snapshot in the background, or (the host short of memory) by the trainer's thread, each decoder
    tensor fetched from the devices as it is written (no text-only directory on the way)."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    import jax
    from flax import nnx

    from areal_jax.checkpoint import CheckpointConfig
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.system import hf_export
    from areal_jax.system.hf_export import HFExporter

    class Tok:
        def save_pretrained(self, directory):
            (tmp_path / directory / "tokenizer.json").write_text("{}")

    cfg, base = _tiny("qwen3"), tmp_path / "base"
    _vl_checkpoint(base, cfg, tied=False)
    model = load_hf_checkpoint(base)
    nnx.update(model, jax.tree.map(lambda x: 1.1 * x, nnx.state(model, nnx.Param)))
    if short_of_memory:
        monkeypatch.setattr(hf_export, "available_host_bytes", lambda: 1024)
    exporter = HFExporter(tmp_path / "run", Tok(), CheckpointConfig(hf_every_steps=1), log=lambda *a: None,
                          source=str(base))
    exporter.export(model, 1)
    exporter.close()
    step = tmp_path / "run" / "hf" / "step_1"
    assert exporter.written == [1] and (step / "tokenizer.json").exists() and exporter.failures == 0
    assert exporter.blocking == int(short_of_memory)
    tokens = random_tokens(cfg.vocab_size, (2, 16), seed=8)
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(step, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(got, np.asarray(model(jnp.asarray(tokens))), atol=1e-4, rtol=0)
    assert not any(p.name.endswith(".decoder") for p in (tmp_path / "run" / "hf").iterdir())  # the text-only stage
