"""Block-scaled fp8 checkpoints (models.fp8: DeepSeek-V3 / R1, Kimi-K2, Qwen3-*-FP8 as released): the raw float8
reader against PyTorch's float8 tensors, the dequantisation by hand, and whole checkpoints whose projections are fp8
loading as a checkpoint of their dequantised weights (computed in PyTorch) does."""
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from areal_jax.models import load_hf_checkpoint
from areal_jax.models.fp8 import PER_TENSOR, block_size, dequantize_blocks, read_raw
from areal_jax.models.hf_io import read_safetensors_dir
from areal_jax.testing import models as testing
from areal_jax.testing.hf import random_tokens


def test_dequantize_blocks_by_hand():
    w = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.float32).astype(ml_dtypes.float8_e4m3fn)
    s = np.array([[2.0, 10.0], [0.5, 1.0]], np.float32)  # blocks of 2 x 2: the last row and column partial
    want = np.array([[2, 4, 30], [8, 10, 60], [3.5, 4, 9]], np.float32)
    np.testing.assert_array_equal(dequantize_blocks(w, s, (2, 2)), want)
    with pytest.raises(ValueError, match="needs factors of shape \\[2, 2\\]"):
        dequantize_blocks(w, s[:1], (2, 2))
    assert block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) == (128, 128)
    assert block_size({"quantization_config": {"quant_method": "mxfp4"}}) is None and block_size({}) is None
    with pytest.raises(ValueError, match=r"must be two positive integers \[rows, columns\], or null"):
        block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})
    assert block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": None}}) == PER_TENSOR
    np.testing.assert_array_equal(dequantize_blocks(w, np.array([0.5], np.float32), PER_TENSOR),
                                  np.arange(1, 10, dtype=np.float32).reshape(3, 3) / 2)
    with pytest.raises(ValueError, match=r"a per-tensor fp8 weight \[3, 3\] needs one factor, got \[2, 2\]"):
        dequantize_blocks(w, s, PER_TENSOR)


def _quantise_checkpoint(src: str, dst: str, block: tuple[int, int] | None) -> dict:
    """Copy of checkpoint `src` at `dst` with every projection weight stored as fp8 e4m3 and its block factors (as
    the released checkpoints are made: a block's largest magnitude maps to 448; block None: one factor a weight,
    stored as [1], weight_block_size null), quantised and dequantised in PyTorch; returns {name: the dequantised
    float32 weight}."""
    torch = pytest.importorskip("torch", reason="the fp8 reference needs PyTorch")
    from safetensors.torch import save_file

    tensors, dequantised, out = read_safetensors_dir(src), {}, {}
    for name, w in tensors.items():
        if w.ndim != 2 or not name.endswith(("proj.weight", "proj_with_mqa.weight")):
            out[name] = torch.tensor(w)
            continue
        t = torch.tensor(w, dtype=torch.float32)
        if block is None:  # transformers' per-tensor layout
            scale = (t.abs().max().clamp(min=1e-12) / 448.0).reshape(1)
            q = (t / scale).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale_inv"], dequantised[name] = q, scale, (q.float() * scale).numpy()
            continue
        rows, cols = -(-t.shape[0] // block[0]), -(-t.shape[1] // block[1])
        scale = torch.ones(rows, cols)
        for i in range(rows):
            for j in range(cols):
                part = t[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
                scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:t.shape[0], :t.shape[1]]
        q = (t / full).to(torch.float8_e4m3fn)
        out[name], out[name + "_scale_inv"] = q, scale
        dequantised[name] = (q.float() * full).numpy()
    os.makedirs(dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": None if block is None else list(block)}
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    return dequantised


def test_read_raw_matches_torch(tmp_path):
    torch = pytest.importorskip("torch", reason="needs PyTorch")
    from safetensors.torch import save_file

    x = torch.randn(5, 7) * 3
    save_file({"a": x.to(torch.float8_e4m3fn), "b": x.to(torch.float8_e5m2), "c": x}, str(tmp_path / "t.safetensors"))
    for name, dtype in (("a", torch.float8_e4m3fn), ("b", torch.float8_e5m2)):
        got = read_raw(str(tmp_path / "t.safetensors"), name)
        assert got.shape == (5, 7)
        np.testing.assert_array_equal(got.astype(np.float32), x.to(dtype).float().numpy())
    with pytest.raises(ValueError, match="not a float8 tensor"):
        read_raw(str(tmp_path / "t.safetensors"), "c")


@pytest.mark.parametrize("arch,block", [("qwen3", (16, 16)), ("deepseek_v3", (16, 16)), ("qwen3", None)])
def test_fp8_checkpoint_loads_as_its_dequantised_weights(tmp_path, arch, block):
    from safetensors.numpy import save_file

    cfg = testing.tiny_config(arch)
    testing.write_random_hf_checkpoint(tmp_path / "plain", cfg, seed=1)
    dequantised = _quantise_checkpoint(str(tmp_path / "plain"), str(tmp_path / "fp8"), block)
    assert len(dequantised) >= 5 * cfg.num_layers - 1  # attention and MLP (or experts) projections
    reference = {**read_safetensors_dir(tmp_path / "plain"), **dequantised}
    os.makedirs(tmp_path / "ref")
    save_file(reference, str(tmp_path / "ref" / "model.safetensors"))
    with open(tmp_path / "ref" / "config.json", "w") as fh:
        fh.write(open(tmp_path / "plain" / "config.json").read())
    tokens = jnp.asarray(random_tokens(97, (2, 16), seed=2))
    got = np.asarray(load_hf_checkpoint(tmp_path / "fp8")(tokens))
    np.testing.assert_allclose(got, np.asarray(load_hf_checkpoint(tmp_path / "ref")(tokens)), rtol=0, atol=1e-6)
    plain = np.asarray(load_hf_checkpoint(tmp_path / "plain")(tokens))
    assert np.abs(got - plain).max() > 1e-3  # the fp8 rounding shows: the quantised weights were read
