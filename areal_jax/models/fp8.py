"""Checkpoints with block-scaled FP8 weights (transformers' "fp8" quantization_config: DeepSeek-V3 / R1 and Kimi-K2
as released, Qwen3's -FP8 checkpoints), dequantised on loading.

Such a checkpoint stores a linear weight `{name}` [out, in] as float8 (e4m3) and beside it `{name}_scale_inv`
[ceil(out / bo), ceil(in / bi)] float32, one factor per block of bo x bi values (config.json's
`quantization_config.weight_block_size`, [128, 128] in all of them): the weight is the stored value times its
block's factor. With `weight_block_size` null the checkpoint is scaled per tensor: one factor a weight (stored as
[1] or [], as transformers writes it), the whole weight one block (`PER_TENSOR`). Other tensors (embeddings, norms, the router, any in `modules_to_not_convert`) are stored as they
are. safetensors' numpy reader has no float8 type, so `read_raw` reads such a tensor's bytes itself (the format: an
8-byte little-endian header length, a JSON header of each tensor's dtype, shape and byte range, then the data) and
views them through ml_dtypes. Saving writes the dequantised weights (no quantization_config).
"""
from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"
PER_TENSOR = (0, 0)  # `block_size` of a checkpoint with one factor a weight
FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def block_size(config: dict) -> tuple[int, int] | None:
    """(bo, bi) of a config.json's fp8 quantization_config (`PER_TENSOR` without weight_block_size), or None when
    the checkpoint is not fp8-quantised."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if block is None:
        return PER_TENSOR
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive integers [rows, "
                         "columns], or null for one scale a tensor.")
    return int(block[0]), int(block[1])


def read_raw(file: str, name: str) -> np.ndarray:
    """Tensor `name` of safetensors `file` as stored (a float8 one as an ml_dtypes array), read from its bytes."""
    with open(file, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
        if name not in header:
            raise KeyError(f"{name!r} is not in {file!r}.")
        info = header[name]
        dtype = FLOAT8.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{name!r} in {file!r} is {info['dtype']}, not a float8 tensor.")
        begin, end = info["data_offsets"]
        fh.seek(8 + length + begin)
        data = fh.read(end - begin)
    return np.frombuffer(data, np.uint8).view(dtype).reshape(info["shape"])


def dequantize_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 [out, in] of an fp8 `weight` [out, in] and its per-block factors `scale_inv` [ceil(out / bo),
    ceil(in / bi)] (the last blocks of a row or column may be partial); with block `PER_TENSOR`, its one factor."""
    if tuple(block) == PER_TENSOR:
        if scale_inv.size != 1:
            raise ValueError(f"a per-tensor fp8 weight {list(weight.shape)} needs one factor, got "
                             f"{list(scale_inv.shape)}; set quantization_config.weight_block_size for block factors.")
        return weight.astype(np.float32) * np.float32(scale_inv.reshape(()))
    if weight.ndim != 2 or scale_inv.shape != tuple(-(-n // b) for n, b in zip(weight.shape, block)):
        raise ValueError(f"an fp8 weight {list(weight.shape)} with blocks {list(block)} needs factors of shape "
                         f"{[-(-n // b) for n, b in zip(weight.shape, block)] if weight.ndim == 2 else '?'}, got "
                         f"{list(scale_inv.shape)}.")
    factors = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], 0), block[1], 1)
    return weight.astype(np.float32) * factors[:weight.shape[0], :weight.shape[1]]
