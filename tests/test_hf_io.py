"""HF checkpoint I/O without torch: layout, sharded files, loading onto a mesh, and error messages."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from areal_jax.models import ModelConfig, load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.hf_io import read_safetensors_dir
from areal_jax.testing.models import tiny_config, write_random_hf_checkpoint

TOKENS = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_save_layout_matches_hf_conventions(tmp_path, arch):
    cfg = tiny_config(arch)
    model = write_random_hf_checkpoint(tmp_path, cfg, seed=3)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    tensors = load_file(tmp_path / "model.safetensors")
    d, h, k, hd, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    assert tensors["model.embed_tokens.weight"].shape == (cfg.vocab_size, d)
    assert tensors["lm_head.weight"].shape == (cfg.vocab_size, d)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (h * hd, d)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (k * hd, d)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (d, h * hd)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (d, f)
    assert ("model.layers.0.self_attn.q_proj.bias" in tensors) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in tensors) == (arch == "qwen3")
    # HF convention y = x @ W.T: check q_proj of layer 0 head 2 against our [D, H, Dh] parameter.
    w_ours = np.asarray(model.layers[0].attn.q_proj[...])
    w_hf = tensors["model.layers.0.self_attn.q_proj.weight"]
    x = np.random.default_rng(0).normal(size=(d,)).astype(np.float32)
    np.testing.assert_allclose((w_hf @ x).reshape(h, hd)[2], x @ w_ours[:, 2, :], rtol=1e-5, atol=1e-6)
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["model_type"] == arch and cfg_json["num_key_value_heads"] == k
    assert ModelConfig.from_pretrained(tmp_path) == cfg


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_single_and_sharded_files(tmp_path, tied):
    cfg = tiny_config("qwen3", tie_word_embeddings=tied)
    model = write_random_hf_checkpoint(tmp_path / "one", cfg, seed=1)
    write_random_hf_checkpoint(tmp_path / "many", cfg, seed=1, max_shard_size=50_000)
    files = sorted(os.listdir(tmp_path / "many"))
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    one, many = read_safetensors_dir(tmp_path / "one"), read_safetensors_dir(tmp_path / "many")
    assert one.keys() == many.keys() and ("lm_head.weight" in one) == (not tied)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in one.values())
    for name in one:
        assert one[name].tobytes() == many[name].tobytes(), name
    reference = model(TOKENS)
    for sub in ("one", "many"):
        loaded = load_hf_checkpoint(tmp_path / sub)
        assert loaded.cfg == cfg
        np.testing.assert_array_equal(loaded(TOKENS), reference)


def test_load_straight_onto_mesh_and_as_bfloat16(tmp_path):
    assert len(jax.devices()) >= 4, "needs 4 devices: tests/conftest.py forces 4 CPU devices; run through pytest"
    cfg = tiny_config("llama")
    model = write_random_hf_checkpoint(tmp_path, cfg, seed=2, max_shard_size=60_000)
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"))
    sharded = load_hf_checkpoint(tmp_path, mesh=mesh)
    q = sharded.layers[1].attn.q_proj[...]
    assert q.sharding.spec == P("fsdp", "tensor", None) and len(q.sharding.device_set) == 4
    np.testing.assert_allclose(sharded(TOKENS), model(TOKENS), atol=1e-5, rtol=1e-5)
    low = load_hf_checkpoint(tmp_path, param_dtype=jnp.bfloat16)
    assert low.cfg.dtype == jnp.bfloat16 and low.layers[0].mlp.up_proj[...].dtype == jnp.bfloat16
    logits = low(TOKENS)
    assert logits.dtype == jnp.float32
    ref = np.asarray(model(TOKENS))
    assert np.abs(np.asarray(logits) - ref).max() < 0.1 * np.abs(ref).max()
    # Saving a bfloat16 model writes bfloat16 tensors and says so in config.json.
    save_hf_checkpoint(low, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(tmp_path / "bf16" / "model.safetensors")["model.norm.weight"].dtype == jnp.bfloat16


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path / "empty")

    cfg = tiny_config("qwen2")
    good = tmp_path / "good"
    write_random_hf_checkpoint(good, cfg)
    config = json.loads((good / "config.json").read_text())
    tensors = load_file(good / "model.safetensors")

    def variant(name, config_changes=None, drop=None, reshape=None, write_weights=True):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
        ts = {k: v for k, v in tensors.items() if k != drop}
        if reshape:
            ts[reshape] = ts[reshape][:-1]
        if write_weights:
            save_file(ts, d / "model.safetensors")
        return d

    with pytest.raises(ValueError, match="Unknown architecture.*gpt2"):
        load_hf_checkpoint(variant("arch", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(FileNotFoundError, match="No model.safetensors"):
        load_hf_checkpoint(variant("noweights", write_weights=False))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf_checkpoint(variant("missing", drop="model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight.*shape \(31, 64\)"):
        load_hf_checkpoint(variant("shape", reshape="model.layers.0.self_attn.k_proj.weight"))
    sharded = tmp_path / "sharded"
    write_random_hf_checkpoint(sharded, cfg, max_shard_size=50_000)
    next(sharded.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-.*missing"):
        load_hf_checkpoint(sharded)
