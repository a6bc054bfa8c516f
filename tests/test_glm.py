"""GLM (GlmForCausalLM: glm-4-9b, glm-4-9b-chat) against HF transformers (PyTorch, float32): q/k/v biases, RoPE on
interleaved pairs of half of each head, gate and up fused in gate_up_proj, Llama's two norms; logits and round trips
both ways, transformers' own config class, glm-4-9b's parameter count, the sampler's decode (dense cache, pages)
against full forwards, LoRA through PEFT (the fused gate_up_proj), the refusals."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("glm", num_layers=3)
    assert cfg.rope_interleave and cfg.rotary_dim == 8 and not cfg.sandwich_norms
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.GlmConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, pad_token_id=0,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.GlmForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.rotary_dim == 8 and ours.cfg.attention_bias and not ours.cfg.attention_out_bias


def test_glm_4_9b_parameter_count():
    """glm-4-9b's config (transformers' GlmConfig defaults, 151,552 tokens): 9,399,951,360 parameters, transformers'
    count of the same config."""
    cfg = ModelConfig.from_hf_dict({"model_type": "glm"})
    assert cfg.num_params == 9_399_951_360 and cfg.rotary_dim == 64 and cfg.num_kv_heads == 2


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("glm", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


@pytest.mark.parity
def test_peft_adapters_on_attention_and_the_fused_mlp(tmp_path):
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from areal_jax.testing.hf import assert_peft_round_trip, peft_exported
    from areal_jax.testing.models import write_random_hf_checkpoint

    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, tiny_config("glm", num_layers=2), seed=0)
    model, lcfg, out = peft_exported(base, tmp_path / "adapter", "q,v,gate,up,down")
    assert_peft_round_trip(out, base, model, lcfg, random_tokens(97, (2, 24), seed=5))


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="rotates 1 of each head's 128 dimensions"):
        ModelConfig.from_hf_dict({"model_type": "glm", "partial_rotary_factor": 1 / 128})
    with pytest.raises(ValueError, match="is not GLM's"):
        ModelConfig.from_hf_dict({"model_type": "glm", "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="HF GLM has Llama's layer rotating interleaved pairs"):
        tiny_config("glm", sliding_window=8).to_hf_dict()
