"""NanoChat (NanoChatForCausalLM) against HF transformers (PyTorch, float32): unscaled RMSNorms (the embeddings'
too), q/k normalised after RoPE turning its pairs the other way, relu^2 MLPs, soft-capped logits; logits and round trips
both ways, transformers' own config class, the sampler's decode against full forwards, LoRA through PEFT, the
refusals."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("nanochat", num_layers=3)
    model = random_model(cfg, seed=0)
    assert model.final_norm.scale is None and model.layers[0].attn.q_norm.scale is None  # no scales at all
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' NanoChatConfig (relu2, a soft cap of 15, kv heads as many as query heads by default)."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    config = transformers.NanoChatConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=256)
    ours = ours_of_their_class(tmp_path, transformers.NanoChatForCausalLM, config, random_tokens(101, (2, 40), seed=1))
    assert ours.cfg.final_logit_softcap == 15.0 and ours.cfg.num_kv_heads == 4 and not ours.cfg.gated_mlp


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("nanochat", num_layers=2), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


@pytest.mark.parity
def test_peft_adapters(tmp_path):
    """Adapters on attention and the MLP's fc1 / fc2: peft applies them with our logits, and they read back."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from areal_jax.testing.hf import assert_peft_round_trip, peft_exported
    from areal_jax.testing.models import write_random_hf_checkpoint

    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, tiny_config("nanochat"), seed=0)
    model, lcfg, out = peft_exported(base, tmp_path / "adapter", "all")
    assert_peft_round_trip(out, base, model, lcfg, random_tokens(97, (2, 24), seed=5))


def test_the_refusals_name_what_to_change():
    d = {"model_type": "nanochat", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 96, "vocab_size": 97}
    with pytest.raises(ValueError, match="no attention biases"):
        ModelConfig.from_hf_dict({**d, "attention_bias": True})
    with pytest.raises(ValueError, match="hidden_act='gelu' is not NanoChat's"):
        ModelConfig.from_hf_dict({**d, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="HF NanoChat has Llama's layer"):
        tiny_config("nanochat", qk_norm=False).to_hf_dict()
