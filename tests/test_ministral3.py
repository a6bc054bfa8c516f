"""Ministral 3 (Ministral3ForCausalLM, and the text decoder of Mistral3ForConditionalGeneration): Mistral's layer with
YaRN and queries scaled by 1 + beta ln(1 + floor(position / original_max_position_embeddings)). The scale worked by
hand, logits against transformers' class (past several multiples of the tiny model's pretraining length of 8, with
a window, in packed rows), round trips, the sampler against full forwards, and the errors that name what differs."""
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.rope import query_position_scale
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_logits, hf_model_of, random_tokens


def test_query_scale_worked_by_hand():
    cfg = testing.tiny_config("ministral3")  # beta 0.5 over a pretraining length of 8
    got = np.asarray(query_position_scale(cfg, jnp.asarray([[0, 7, 8, 15, 16, 39, -1]])))
    want = [1.0, 1.0, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(3), 1 + 0.5 * math.log(5), 1.0]
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    assert query_position_scale(testing.tiny_config("mistral"), jnp.zeros((1, 3), jnp.int32)) is None
    # the released checkpoints' 16,384 positions: 1 until then, 1 + 0.1 ln 2 from there
    released = ModelConfig.from_hf_dict({"model_type": "ministral3"})
    np.testing.assert_allclose(np.asarray(query_position_scale(released, jnp.asarray([[16383, 16384]])))[0],
                               [1.0, 1 + 0.1 * math.log(2)], rtol=1e-6)


def test_config_wrapper_and_what_is_refused():
    cfg = ModelConfig.from_hf_dict({"model_type": "ministral3"})  # every key from transformers' Ministral3Config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (34, 4096, 32, 8, 128)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 16.0
    assert cfg.rope_scaling["llama_4_scaling_beta"] == 0.1 and cfg.rope_theta == 1e6 and cfg.sliding_window is None
    text = {"model_type": "ministral3", "num_hidden_layers": 26, "hidden_size": 3072, "intermediate_size": 9216,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072,
            "tie_word_embeddings": True}
    wrapped = ModelConfig.from_hf_dict({"model_type": "mistral3", "text_config": text, "eos_token_id": 2,
                                        "vision_config": {"model_type": "pixtral"}})
    assert wrapped == ModelConfig.from_hf_dict(text) and wrapped.architecture == "ministral3"
    # transformers ties the output matrix to the embedding by the outer file's flag (default True), not text_config's
    assert not ModelConfig.from_hf_dict({"model_type": "mistral3", "text_config": text,
                                         "tie_word_embeddings": False}).tie_word_embeddings
    assert ModelConfig.from_hf_dict({"model_type": "mistral3", "text_config": {
        **text, "tie_word_embeddings": False}}).tie_word_embeddings
    small = ModelConfig.from_hf_dict({"model_type": "mistral3", "text_config": {  # Mistral-Small-3.x: plain Mistral
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 97}})
    assert small.architecture == "mistral"
    with pytest.raises(ValueError, match="needs a text_config"):
        ModelConfig.from_hf_dict({"model_type": "mistral3"})
    with pytest.raises(ValueError, match="llama_4_scaling_beta"):
        ModelConfig.from_hf_dict({"model_type": "ministral3", "rope_parameters": {"rope_type": "default",
                                                                                 "rope_theta": 1e6}})
    with pytest.raises(ValueError, match="biases on the projections"):
        ModelConfig.from_hf_dict({"model_type": "ministral3", "attention_bias": True})
    with pytest.raises(ValueError, match="scales its queries by position"):
        testing.tiny_config("ministral3", rope_scaling=None).to_hf_dict()
    with pytest.raises(ValueError, match="set attention_bias=False, qk_norm=False"):
        testing.tiny_config("ministral3", qk_norm=True).to_hf_dict()


@pytest.mark.parity
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 1, "tie_word_embeddings": True, "sliding_window": 12}])
def test_model_matches_transformers_and_round_trips(tmp_path, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("ministral3", **overrides)
    hf = hf_model_of(cfg, seed=1)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    tokens = random_tokens(97, (2, 40), seed=2)  # positions 0..39: five multiples of the pretraining length
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, tokens)
    # packed rows: each segment's positions restart, and so does its queries' scale
    positions = np.concatenate([np.arange(17), np.arange(23)])[None].repeat(2, 0)
    segments = np.concatenate([np.ones(17), 2 * np.ones(23)]).astype(np.int32)[None].repeat(2, 0)
    got = np.asarray(ours.unembed(ours.hidden(jnp.asarray(tokens), positions=jnp.asarray(positions),
                                              segment_ids=jnp.asarray(segments))))
    for lo, hi in ((0, 17), (17, 40)):
        np.testing.assert_allclose(got[:, lo:hi], hf_logits(hf, tokens[:, lo:hi]), atol=1e-4, rtol=0)
    # the comparison sees the scale: without it (beta 0) the logits move well past the tolerance
    plain = ours.cfg.replace(rope_scaling={**ours.cfg.rope_scaling, "llama_4_scaling_beta": 0.0})
    unscaled = testing.random_model(plain, seed=0)
    nnx.update(unscaled, nnx.state(ours, nnx.Param))
    moved = np.abs(np.asarray(unscaled.unembed(unscaled.hidden(jnp.asarray(tokens)))) - hf_logits(hf, tokens))
    assert moved[:, :8].max() < 1e-4 and moved[:, 8:].max() > 1e-2


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("ministral3"), seed=3)
    # prompts of 10, 2 and 3 tokens and 16 new ones each: decoding crosses two multiples of the pretraining length
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


def test_an_image_and_text_checkpoint_loads_its_text_decoder(tmp_path):
    """Mistral3ForConditionalGeneration (how Ministral 3 ships): the decoder's config under text_config, its
    weights under a prefix; text-only logits equal the HF model's, and the vision tower is left on disk."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import randomize_torch

    cfg = testing.tiny_config("ministral3")
    text = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                  image_size=28, patch_size=14)
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=96,
                                         tie_word_embeddings=False)
    hf = randomize_torch(transformers.Mistral3ForConditionalGeneration(config).eval(), seed=4)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.cfg == cfg
    tokens = random_tokens(96, (2, 30), seed=2)  # text tokens only (no image placeholders)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), want, atol=1e-4, rtol=0)
    # saved text-only, then written back into the image-and-text checkpoint (the export program's default)
    from areal_jax.testing.hf import rewrapped_logits

    again = rewrapped_logits(ours, tmp_path, tmp_path / "export", transformers.Mistral3ForConditionalGeneration, tokens)
    np.testing.assert_allclose(again, want, atol=1e-4, rtol=0)
