"""An image-and-text checkpoint written back whole (`rewrap`): the trained text decoder under the source checkpoint's
names and layout, the vision tower and everything else copied from the source.

A job trains only the text decoder of an image-and-text checkpoint (Gemma 3 4B and up, Mistral 3, Qwen3.5, Qwen3-VL,
LFM2-VL, LFM3-VL);
`save_hf_checkpoint` writes that decoder as a text-only model. `rewrap` turns such a directory into the source's
form: each source tensor the decoder holds is replaced by the trained one (its name found as the loader finds it:
`model.language_model.*`, `language_model.model.*`, `language_model.lm_head.*`; Qwen3-VL-MoE's stacked experts stacked
again from the per-expert tensors), the other source tensors are copied as they are, with the source's config.json
and its processor files, so transformers loads the image-and-text model with the new decoder.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping

import numpy as np

from areal_jax.models import lfm2, ministral3, qwen3_5, qwen3_vl, stacked_experts

# Image-and-text checkpoints (their config.json's model_type) whose text decoder a job trains, as the family modules
# name them; "gemma3" is Gemma3ForConditionalGeneration's (the text-only model's is "gemma3_text").
WRAPPED = ("gemma3", ministral3.WRAPPER, *qwen3_5.WRAPPERS, qwen3_vl.WRAPPER, qwen3_vl.MOE_WRAPPER, *lfm2.WRAPPERS)
_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1}
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def wrapper_type(source_dir: str | os.PathLike) -> str | None:
    """The model_type of the image-and-text checkpoint at `source_dir`, or None (a text-only one, or no
    readable config.json)."""
    try:
        with open(os.path.join(source_dir, "config.json")) as fh:
            model_type = json.load(fh).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if model_type in WRAPPED else None


class _Held:
    """Text-only tensors held in memory ({HF name: array}, a HostCheckpoint's), read as `_Reader` reads a directory."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors = tensors
        self.weight_map = dict.fromkeys(tensors)

    def read(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def nbytes(self, name: str) -> int:
        return int(self.tensors[name].nbytes)


class _Model:
    """A model's text-only tensors, each fetched to the host when read (`hf_io`'s layout, gathered one at a time: every
    process must read them in the same order), read as `_Reader` reads a directory."""

    def __init__(self, model: Any, dtype: Any):
        from areal_jax.models.hf_io import _hf_layout

        _, groups, self.flat, self.dtype, sizes = _hf_layout(model, dtype)
        self.groups = {g[0].hf_name: g for g in groups}
        self.sizes = {g[0].hf_name: size for g, size in zip(groups, sizes)}
        self.weight_map = dict.fromkeys(self.groups)
        self.held: dict = {}  # the stacked experts' parameters being sliced (Qwen3-VL-MoE reads gate, up, down by turns)

    def read(self, name: str) -> np.ndarray:
        from areal_jax.models.hf_io import _hf_tensor

        return _hf_tensor(self.groups[name], self.flat, self.dtype, self.held, keep=3)

    def nbytes(self, name: str) -> int:
        return self.sizes[name]


def rewrap(text: Any, source_dir: str | os.PathLike, out_dir: str | os.PathLike,
           max_shard_size: int | None = None, *, dtype: Any = None, writer: bool = True) -> list[str]:
    """Write at `out_dir` the image-and-text checkpoint at `source_dir` with its text decoder's tensors taken from
    `text`: the text-only checkpoint directory save_hf_checkpoint writes, its tensors in memory ({HF name: array}, a
    HostCheckpoint's), or the model itself (a Transformer: each tensor fetched from the devices as it is written, in
    `dtype`, default the param dtype; sharded arrays are gathered, so every process calls this with `writer` True on
    process 0 only). The last two spare writing the decoder and reading it back. One shard of at most
    `max_shard_size` bytes is in memory at a time. Returns the names of the source tensors copied unchanged (the
    vision tower's and the projector's)."""
    from areal_jax.models.hf_io import _Reader, _write_files
    from areal_jax.models.transformer import Transformer

    source_dir, out_dir = os.fspath(source_dir), os.fspath(out_dir)
    with open(os.path.join(source_dir, "config.json")) as fh:
        config = json.load(fh)
    if wrapper_type(source_dir) is None:
        raise ValueError(f"{source_dir!r} is not an image-and-text checkpoint (model_type {config.get('model_type')!r} "
                         f"is none of {', '.join(WRAPPED)}); its text-only export is the whole model.")
    if config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config"):
        raise ValueError(f"{source_dir!r} is quantized (quantization_config); its trained decoder is exported "
                         "unquantized, which its config does not describe. Export the text-only model instead.")
    src = _Reader(source_dir)
    if isinstance(text, Transformer):
        text = _Model(text, dtype)
    elif isinstance(text, Mapping):
        text = _Held(text)
    else:
        text = _Reader(os.fspath(text))
        text.nbytes = lambda n: _nbytes(text._handle(n).get_slice(text.names[n]))
    taken: dict[str, Any] = {}  # source name -> the text tensor(s) that replace it
    for name in text.weight_map:
        if name in src.names:
            taken[src.names[name]] = name
            continue
        stacked = stacked_experts.source(name, src.names)
        if stacked is None:
            raise ValueError(f"The exported decoder's tensor {name!r} has no place in {source_dir!r}; the run's model "
                             "is not that checkpoint's decoder.")
        taken.setdefault(src.names[stacked[0]], {})[(stacked[1], stacked[2])] = name
    names = list(src.weight_map)
    copied = [n for n in names if n not in taken]

    def tensor(i: int) -> np.ndarray:
        got = taken.get(names[i])
        if got is None:  # a source name answers to itself in the reader (read by the writing process only)
            return src._handle(names[i]).get_tensor(names[i]) if writer else np.empty(0, np.uint8)
        if isinstance(got, str):
            return text.read(got)
        return stacked_experts.stack({key: text.read(n) for key, n in got.items()})

    def size(i: int) -> int:
        got = taken.get(names[i])
        if got is None:
            return _nbytes(src._handle(names[i]).get_slice(names[i]))
        return sum(text.nbytes(n) for n in ([got] if isinstance(got, str) else got.values()))

    _write_files(out_dir, config, names, [size(i) for i in range(len(names))], tensor, writer, max_shard_size)
    for f in sorted(os.listdir(source_dir)) if writer else ():  # the processor's files (preprocessor, chat template)
        full = os.path.join(source_dir, f)
        if os.path.isfile(full) and f != "config.json" and not f.endswith(_WEIGHT_FILES):
            shutil.copyfile(full, os.path.join(out_dir, f))
    return copied


def _nbytes(sl: Any) -> int:
    return int(np.prod(sl.get_shape())) * _BYTES.get(sl.get_dtype(), 4)
