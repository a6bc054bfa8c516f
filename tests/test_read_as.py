"""Checkpoints whose own code runs a transformers family's layers plus parts left out here (`hf_config.READ_AS`):
MiMo (MiMo-7B-Base / RL: Qwen2's layers and multi-token-prediction layers) loads as Qwen2 with a warning naming what
is left out, its extra tensors unread; its logits are transformers' Qwen2 model's on the same weights."""
import json
import os

import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import hf_logits, hf_model_of, random_tokens
from areal_jax.testing.models import tiny_config


def _as_mimo(directory) -> None:
    """Rewrites a saved Qwen2 directory as MiMo's: its config.json's model type and class, one MTP layer's tensors
    beside the decoder's (random, so reading them would show)."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(directory, "config.json")
    with open(path) as fh:
        d = json.load(fh)
    d.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1,
             auto_map={"AutoConfig": "configuration_mimo.MiMoConfig",
                       "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    with open(path, "w") as fh:
        json.dump(d, fh)
    weights = os.path.join(directory, "model.safetensors")
    tensors = load_file(weights)
    rng = np.random.default_rng(0)
    for name in ("input_layernorm.weight", "token_layernorm.weight", "hidden_layernorm.weight",
                 "self_attn.q_proj.weight", "final_layernorm.weight"):
        tensors[f"model.mtp_layers.0.{name}"] = rng.normal(size=(64, 64) if "proj" in name else (64,)).astype(np.float32)
    save_file(tensors, weights, metadata={"format": "pt"})


@pytest.mark.parity
def test_mimo_loads_as_qwen2_and_is_saved_as_it(tmp_path):
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    import jax.numpy as jnp

    from areal_jax.models import load_hf_checkpoint, save_hf_checkpoint

    cfg = tiny_config("qwen2")
    hf = hf_model_of(cfg, seed=1)
    hf.save_pretrained(tmp_path / "mimo")
    _as_mimo(tmp_path / "mimo")
    tokens = random_tokens(97, (2, 20), seed=2)
    with pytest.warns(UserWarning, match="MiMo's multi-token-prediction layers .* are left out"):
        ours = load_hf_checkpoint(tmp_path / "mimo")
    assert ours.cfg == cfg
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)
    save_hf_checkpoint(ours, tmp_path / "ours")
    with open(tmp_path / "ours" / "config.json") as fh:
        written = json.load(fh)
    assert written["model_type"] == "qwen2" and "num_nextn_predict_layers" not in written
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(hf, tokens))


def test_an_unknown_model_type_names_the_readable_ones():
    with pytest.raises(ValueError, match="supported model types are .*qwen2.*; read as others: mimo \\(as qwen2\\)"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})
