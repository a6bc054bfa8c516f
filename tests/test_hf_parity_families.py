"""Gemma 3 (text), OLMo 2 / 3 and sliding-window Mistral / Qwen2 against HF transformers (PyTorch, float32):
logits past several windows, checkpoint round trips, bfloat16 compute, and the HF configs' layouts."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from areal_jax.models import Transformer, load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import read_safetensors_dir
from areal_jax.models.wrapped_export import rewrap
from areal_jax.testing.hf import hf_logits as _hf_logits
from areal_jax.testing.hf import random_tokens as _tokens
from areal_jax.testing.hf import randomize_torch
from areal_jax.testing.models import tiny_config, write_random_hf_checkpoint

torch = pytest.importorskip("torch", reason="parity tests need PyTorch (pip install areal_jax[parity])")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers (areal_jax[parity])")

pytestmark = pytest.mark.parity

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
HF_CONFIGS = {
    # Gemma 3: local layers (window 5, their own RoPE base), a global one with linear RoPE scaling (as 4B and up),
    # query_pre_attn_scalar 24 against head_dim 16 (as 27B, where they differ).
    "gemma3": lambda tied: transformers.Gemma3TextConfig(
        vocab_size=101, hidden_size=48, intermediate_size=88, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=5, max_position_embeddings=512, layer_types=TYPES,
        query_pre_attn_scalar=24, tie_word_embeddings=tied, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # Mistral 7B v0.1's layout: every layer slides.
    "mistral": lambda tied: transformers.MistralConfig(
        vocab_size=109, hidden_size=40, intermediate_size=76, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=1, head_dim=12, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        max_position_embeddings=512, sliding_window=6),
    # OLMo 2: norms after attention and MLP only, q/k norms over all heads together.
    "olmo2": lambda tied: transformers.Olmo2Config(
        vocab_size=103, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=tied, max_position_embeddings=512),
    # OLMo 3: OLMo 2's layer, a window over three layers of four, YaRN on the global layers only (as 7B's 64k).
    "olmo3": lambda tied: transformers.Olmo3Config(
        vocab_size=107, hidden_size=48, intermediate_size=88, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=512, sliding_window=6,
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                            "original_max_position_embeddings": 64},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}),
    # SmolLM3: Llama's layer, every fourth one without rotary embeddings (NoPE).
    "smollm3": lambda tied: transformers.SmolLM3Config(
        vocab_size=109, hidden_size=40, intermediate_size=76, num_hidden_layers=4, num_attention_heads=5,
        num_key_value_heads=1, rope_theta=5e6, tie_word_embeddings=tied, max_position_embeddings=512,
        pad_token_id=0),
    # Qwen2 with use_sliding_window: layers from max_window_layers on slide.
    "qwen2": lambda tied: transformers.Qwen2Config(
        vocab_size=101, hidden_size=48, intermediate_size=88, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=tied, max_position_embeddings=512,
        use_sliding_window=True, sliding_window=7, max_window_layers=1),
}
HF_CLASSES = {"gemma3": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
CASES = [("gemma3", True), ("gemma3", False), ("mistral", False), ("qwen2", True), ("olmo2", False), ("olmo2", True),
         ("olmo3", False), ("smollm3", True)]


def _hf_model(arch, tied, path, seed=0):
    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASSES[arch])(HF_CONFIGS[arch](tied)).to(torch.float32).eval()
    randomize_torch(model, seed, norm_center=0.0 if arch == "gemma3" else 1.0)  # every tensor matters
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch,tied", CASES)
def test_logits_match_transformers_past_several_windows(tmp_path, arch, tied):
    hf = _hf_model(arch, tied, tmp_path, seed=len(arch) + tied)
    ours = load_hf_checkpoint(tmp_path)
    cfg = ours.cfg
    assert cfg.architecture == arch and cfg.tie_word_embeddings == tied
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    assert windows == {"gemma3": [5, None, 5, 5], "mistral": [6, 6], "qwen2": [None, 7, 7], "olmo2": [None, None],
                       "olmo3": [6, 6, 6, None], "smollm3": [None] * 4}[arch]
    tokens = _tokens(cfg.vocab_size, (2, 40))
    ref = _hf_logits(hf, tokens)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    positions = np.broadcast_to(np.arange(300, 340, dtype=np.int32), (2, 40))
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens), jnp.asarray(positions))),
                               _hf_logits(hf, tokens, positions), atol=1e-4, rtol=0)
    if arch == "olmo2":
        return
    # the windows (SmolLM3: the layers without RoPE) have teeth: the same weights otherwise give other logits
    if arch == "smollm3":
        assert cfg.rope_layers == (1, 1, 1, 0) and [cfg.layer_rope(i) for i in range(4)][-1] == "none"
    full_cfg = cfg.replace(rope_layers=None) if arch == "smollm3" else cfg.replace(sliding_window=1000)
    unwindowed = Transformer(full_cfg, rngs=nnx.Rngs(0))
    nnx.update(unwindowed, nnx.state(ours))
    assert np.abs(np.asarray(unwindowed(jnp.asarray(tokens))) - ref).max() > 1e-2


@pytest.mark.parametrize("arch,tied", CASES)
def test_hf_to_ours_to_hf_is_byte_identical_and_loads_back(tmp_path, arch, tied):
    _hf_model(arch, tied, tmp_path / "hf", seed=3)
    ours = load_hf_checkpoint(tmp_path / "hf")
    save_hf_checkpoint(ours, tmp_path / "ours")
    before, after = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "ours")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert tensor.tobytes() == after[name].tobytes(), name
    assert load_hf_checkpoint(tmp_path / "ours").cfg == ours.cfg
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(again).__name__ == HF_CLASSES[arch]
    tokens = _tokens(again.config.vocab_size, (1, 30), seed=2)
    np.testing.assert_array_equal(_hf_logits(again, tokens), _hf_logits(original, tokens))


def test_our_gemma3_checkpoint_loads_in_transformers(tmp_path):
    cfg = tiny_config("gemma3", num_layers=3, tie_word_embeddings=True)
    ours = write_random_hf_checkpoint(tmp_path, cfg, seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM" and hf.config.layer_types == list(cfg.layer_types)
    tokens = _tokens(cfg.vocab_size, (2, 30), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), _hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_image_and_text_checkpoint_loads_its_text_decoder(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text decoder under text_config and under a
    prefix (language_model.model.* on the hub, model.language_model.* as transformers names it in memory). Its
    text-only logits equal the HF model's on text tokens, and re-saving writes a Gemma3ForCausalLM that
    transformers loads with the same logits."""
    text = dict(vocab_size=101, hidden_size=48, intermediate_size=88, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=5, max_position_embeddings=512,
                layer_types=TYPES[:3], query_pre_attn_scalar=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=100, boi_token_index=98, eoi_token_index=99)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name:
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(0.1 * noise if name.endswith("norm.weight") else
                        noise if p.ndim == 1 or "embed_tokens" in name else noise / p.shape[1] ** 0.5)
    hf.save_pretrained(tmp_path / "hub")
    tokens = _tokens(98, (2, 24), seed=4)  # text tokens only (no image placeholders)
    ref = _hf_logits(hf, tokens)
    ours = load_hf_checkpoint(tmp_path / "hub")
    assert ours.cfg.architecture == "gemma3" and [ours.cfg.layer_window(i) for i in range(3)] == [5, None, 5]
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    # the in-memory names: model.language_model.*
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    tensors = read_safetensors_dir(tmp_path / "hub")
    save_file({name.replace("language_model.model.", "model.language_model."): t for name, t in tensors.items()},
              str(renamed / "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(load_hf_checkpoint(renamed)(jnp.asarray(tokens))),
                                  np.asarray(ours(jnp.asarray(tokens))))
    save_hf_checkpoint(ours, tmp_path / "text")
    text_only = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    assert type(text_only).__name__ == "Gemma3ForCausalLM"
    np.testing.assert_allclose(_hf_logits(text_only, tokens), ref, atol=1e-4, rtol=0)
    # and written back into the image-and-text checkpoint (the export program's default), vision tower and all
    copied = rewrap(tmp_path / "text", tmp_path / "hub", tmp_path / "whole")
    assert copied and not any("language_model" in n for n in copied)
    whole = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "whole", dtype=torch.float32)
    np.testing.assert_allclose(_hf_logits(whole.eval(), tokens), ref, atol=1e-4, rtol=0)


def test_gemma3_bfloat16_compute_stays_close_to_float32(tmp_path):
    hf = _hf_model("gemma3", True, tmp_path, seed=6)
    tokens = _tokens(101, (2, 32), seed=3)
    ref = _hf_logits(hf, tokens)
    for param_dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(load_hf_checkpoint(tmp_path, param_dtype=param_dtype, dtype=jnp.bfloat16)(
            jnp.asarray(tokens)))
        assert np.abs(got - ref).max() < 0.03 * np.abs(ref).max()
        assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def test_hf_config_layouts():
    """What the config.json of the real checkpoints says, read as their model classes read it."""
    gemma_1b = {  # google/gemma-3-1b-it's config.json (the keys that matter)
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000, "rope_theta": 1000000, "rope_scaling": None,
        "sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 32768,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "rms_norm_eps": 1e-6}
    cfg = ModelConfig.from_hf_dict(gemma_1b)
    assert [i for i in range(26) if cfg.layer_window(i) is None] == [5, 11, 17, 23]
    assert cfg.rope_local_theta == 10000 and cfg.rope_theta == 1e6 and cfg.tie_word_embeddings
    assert cfg.attention_scale_factor == 1.0 and abs(cfg.num_params - 999_885_952) < 1
    for key, value, match in [("final_logit_softcapping", 30.0, "soft-capping"),
                              ("hidden_activation", "gelu", "not supported for gemma3")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**gemma_1b, key: value})
    # gemma-3-4b-it's config.json: its text_config lists only what differs from transformers' defaults
    gemma_4b = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
                "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                "sliding_window": 1024}}
    cfg = ModelConfig.from_hf_dict(gemma_4b)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262_208)
    assert cfg.rope_scaling == {"factor": 8.0, "rope_type": "linear"} and cfg.rope_local_theta == 10000
    assert [i for i in range(34) if cfg.layer_window(i) is None] == [5, 11, 17, 23, 29]
    assert cfg.layer_window(0) == 1024 and cfg.eos_token_id == (1, 106)
    with pytest.raises(ValueError, match="needs a text_config"):
        ModelConfig.from_hf_dict({"model_type": "gemma3"})
    # a window at least the context long changes nothing and is dropped (Mistral's kernels stay window-free)
    mistral = {"model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
               "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 4096}
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": 4096}).sliding_window is None
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": 4000}).layer_window(1) == 4000
    qwen = {**mistral, "model_type": "qwen2", "sliding_window": 100, "max_window_layers": 1}
    assert ModelConfig.from_hf_dict(qwen).sliding_window is None  # use_sliding_window false: the window is unused
    assert [ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True}).layer_window(i) for i in (0, 1)] == \
        [None, 100]
