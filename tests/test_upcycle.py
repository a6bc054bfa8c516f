"""Sparse upcycling (programs.upcycle): the mixture of experts starts as the dense model's function (our logits and
transformers'), every expert a copy of its layer's MLP, the router random, and the errors."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import load_hf_checkpoint
from areal_jax.programs.upcycle import main, upcycle, upcycled_config
from areal_jax.testing.models import random_model, tiny_config, write_random_hf_checkpoint

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 13)), jnp.int32)


@pytest.mark.parametrize("arch,sibling", [("qwen2", "qwen2_moe"), ("qwen3", "qwen3_moe"), ("llama", "mixtral"),
                                          ("granite", "granitemoe"), ("olmo2", "flex_olmo")])
def test_the_upcycled_model_computes_the_dense_function(arch, sibling):
    dense = random_model(tiny_config(arch), seed=1)
    moe = upcycle(dense, experts=4, top_k=2, seed=2)
    assert moe.cfg.architecture == sibling and moe.cfg.num_experts == 4 and moe.cfg.norm_topk_prob
    layer = moe.layers[1].mlp
    for name in ("gate", "up", "down"):
        want = np.asarray(getattr(dense.layers[1].mlp, f"{name}_proj")[...])
        got = np.asarray(getattr(layer, f"experts_{name}")[...])
        assert got.shape == (4, *want.shape)
        for e in range(4):
            np.testing.assert_array_equal(got[e], want)
    assert float(jnp.abs(layer.router[...]).max()) > 0  # the router is random: its picks differ per token
    np.testing.assert_allclose(np.asarray(moe(TOKENS)), np.asarray(dense(TOKENS)), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "olmo2"])
def test_the_command_writes_a_directory_transformers_loads_with_the_dense_logits(tmp_path, arch, capsys):
    dense_dir, out = str(tmp_path / "dense"), str(tmp_path / "moe")
    dense = write_random_hf_checkpoint(dense_dir, tiny_config(arch), seed=3)
    with open(os.path.join(dense_dir, "tokenizer_config.json"), "w") as fh:
        json.dump({"model_max_length": 64}, fh)
    for name in ("added_tokens.json", "qwen.tiktoken", "LICENSE", "pytorch_model.bin", "model-q4.gguf"):
        with open(os.path.join(dense_dir, name), "w") as fh:  # files of no fixed list; old weights left behind
            fh.write(name)
    summary = main(["--model", dense_dir, "--out", out, "--experts", "3", "--top_k", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert summary["max_logit_diff"] < 1e-4 and summary["params"] > summary["dense_params"]
    for name in ("tokenizer_config.json", "added_tokens.json", "qwen.tiktoken", "LICENSE"):
        assert open(os.path.join(out, name)).read() == open(os.path.join(dense_dir, name)).read()
    assert not os.path.exists(os.path.join(out, "pytorch_model.bin")) and not os.path.exists(
        os.path.join(out, "model-q4.gguf"))
    assert json.load(open(os.path.join(out, "config.json")))["num_local_experts" if arch == "llama" else
                                                              "num_experts"] == 3  # ours, not the dense one
    np.testing.assert_allclose(np.asarray(load_hf_checkpoint(out)(TOKENS)), np.asarray(dense(TOKENS)), atol=2e-5)
    torch = pytest.importorskip("torch", reason="the transformers check needs PyTorch")
    transformers = pytest.importorskip("transformers", reason="the transformers check needs transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    with torch.no_grad():
        got = hf(torch.tensor(np.asarray(TOKENS), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, np.asarray(dense(TOKENS)), atol=1e-4, rtol=0)


def test_upcycle_errors():
    with pytest.raises(ValueError, match="a mixture of experts already"):
        upcycled_config(tiny_config("qwen3_moe"), 4, 2)
    with pytest.raises(ValueError, match="No mixture-of-experts sibling for 'gemma3'"):
        upcycled_config(tiny_config("gemma3"), 4, 2)
    with pytest.raises(ValueError, match="--top_k=5 must be between 1 and --experts=4"):
        upcycled_config(tiny_config("qwen2"), 4, 5)
