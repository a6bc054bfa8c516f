"""EXAONE 3 / 3.5 and EXAONE Deep (model type exaone: Llama's layer under its own names) against HF transformers
(PyTorch, float32): logits and round trips both ways through transformers' ExaoneConfig (its LlamaForCausalLM), a
checkpoint in the released layout (transformer.wte / h.{i}.attn.attention.* / ln_1 / ln_2 / mlp.c_fc_0 ... and the
config's num_layers, layer_norm_epsilon, activation_function) loading with the same logits, EXAONE-3.5-2.4B's
parameter count, the refusals."""
import json

import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, random_tokens
from areal_jax.testing.models import tiny_config

RELEASED = {".self_attn.o_proj.": ".attn.attention.out_proj.", ".self_attn.": ".attn.attention.",
            ".input_layernorm.": ".ln_1.", ".post_attention_layernorm.": ".ln_2.", ".mlp.gate_proj.": ".mlp.c_fc_0.",
            ".mlp.up_proj.": ".mlp.c_fc_1.", ".mlp.down_proj.": ".mlp.c_proj."}


def _hf(cfg, transformers):
    from areal_jax.testing.hf import randomize_torch

    d = cfg.to_hf_dict()
    config = transformers.ExaoneConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    return randomize_torch(transformers.LlamaForCausalLM(config).eval(), seed=1)


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("exaone", num_layers=3)
    hf = _hf(cfg, transformers)
    assert hf.config.model_type == "exaone"
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_a_checkpoint_in_the_released_layout_loads(tmp_path):
    """transformers' model saved, then its tensors renamed to the released transformer.* names and its config.json
    given EXAONE's own keys: our model of it has transformers' logits."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from safetensors.numpy import save_file

    from areal_jax.models import load_hf_checkpoint
    from areal_jax.models.hf_io import read_safetensors_dir
    from areal_jax.testing.hf import hf_logits

    cfg = tiny_config("exaone", num_layers=2)
    hf = _hf(cfg, transformers)
    hf.save_pretrained(tmp_path / "hf")
    tensors = {}
    for name, value in read_safetensors_dir(tmp_path / "hf").items():
        for ours, theirs in RELEASED.items():
            name = name.replace(ours, theirs)
        name = name.replace("model.embed_tokens.", "transformer.wte.").replace("model.layers.", "transformer.h.")
        tensors[name.replace("model.norm.", "transformer.ln_f.")] = value
    assert "transformer.h.0.mlp.c_fc_0.weight" in tensors and "transformer.ln_f.weight" in tensors
    (tmp_path / "released").mkdir()
    save_file(tensors, str(tmp_path / "released" / "model.safetensors"))
    d = json.loads((tmp_path / "hf" / "config.json").read_text())
    d.update(architectures=["ExaoneForCausalLM"], num_layers=d.pop("num_hidden_layers"),
             layer_norm_epsilon=d.pop("rms_norm_eps"), activation_function=d.pop("hidden_act"))
    (tmp_path / "released" / "config.json").write_text(json.dumps(d))
    ours = load_hf_checkpoint(tmp_path / "released")
    assert ours.cfg.replace(dtype=cfg.dtype) == cfg.replace(eos_token_id=ours.cfg.eos_token_id)
    tokens = random_tokens(97, (2, 24), seed=3)
    np.testing.assert_allclose(np.asarray(ours(tokens)), hf_logits(hf, tokens), atol=1e-4)


def test_exaone_3_5_2_4b_parameter_count():
    """EXAONE-3.5-2.4B's config.json (its own keys, tied embeddings): 2,405,327,360 parameters."""
    d = {"model_type": "exaone", "architectures": ["ExaoneForCausalLM"], "vocab_size": 102400, "hidden_size": 2560,
         "intermediate_size": 7168, "num_layers": 30, "num_attention_heads": 32, "num_key_value_heads": 8,
         "layer_norm_epsilon": 1e-5, "activation_function": "silu", "tie_word_embeddings": True,
         "max_position_embeddings": 32768, "rope_theta": 1000000.0}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.num_layers == 30 and cfg.rms_norm_eps == 1e-5 and cfg.head_dim == 80
    assert cfg.num_params == 2_405_327_360


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="EXAONE 3 has no biases"):
        ModelConfig.from_hf_dict({"model_type": "exaone", "attention_bias": True})
    with pytest.raises(ValueError, match="is not EXAONE 3's"):
        ModelConfig.from_hf_dict({"model_type": "exaone", "activation_function": "gelu"})
    assert ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                                     "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 97}).architecture \
        == "llama"  # (a config.json without model_type naming LlamaForCausalLM stays Llama's)
