"""HF checkpoints in and out: config.json + model.safetensors, or sharded model-*.safetensors with an index.

Weight layout: HF stores linear weights as [out, in]; here projections are [in, ...out] (q_proj [D, H, Dh],
o_proj [H, Dh, D], gate/up [D, F], down [F, D], lm_head [D, V]). Conversions are exact transposes and
reshapes, so HF -> here -> HF reproduces every tensor byte for byte (at the same dtype).
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from areal_jax.knobs import Section, knob
from areal_jax.models import disk_names, fp8, stacked_experts
from areal_jax.models.config import EXPERT_DISPATCHES, MOE_IMPLS, ModelConfig
from areal_jax.models.gpt_oss import MXFP4_SUFFIXES, dequantize_mxfp4
from areal_jax.models.hf_names import _Entry, weight_entries
from areal_jax.models.sharding import logical_to_mesh_sharding
from areal_jax.models.transformer import Transformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass(frozen=True)
class ModelLoadConfig(Section):
    """Which checkpoint a job starts from and in which dtypes (the config's `model` section)."""

    section: ClassVar[str] = "model"

    path: str = knob("", "HF directory: config.json + *.safetensors (+ tokenizer files)")
    tokenizer_path: str = knob("", "directory of the tokenizer files; defaults to model.path")
    dtype: str = knob("float32", "compute dtype", choices=tuple(DTYPES))
    param_dtype: str = knob("float32", "storage dtype of the trained params", choices=tuple(DTYPES))
    moe_impl: str = knob("auto", "how a mixture of experts computes (models.moe): auto (ragged on TPU; on GPUs pallas "
                         "under expert parallelism, dense at decode (at most 256 tokens a device); else blocked) "
                         "| blocked | ragged | pallas | dense; other models ignore it", choices=MOE_IMPLS)
    expert_parallel: bool = knob(True, "train a mixture of experts with expert parallelism where the expert count "
                                 "divides the fsdp axis (models.expert_parallel: each device keeps its own experts, "
                                 "the tokens go to them); False: FSDP gathers every expert's weights")
    expert_dispatch: str = knob("auto", "how expert parallelism sends the tokens to the experts: gather (all-gather "
                                "every device's rows: buffers grow with the fsdp size) | ring (pass them round the "
                                "fsdp ring: flat memory, about 1.25x the bytes and one more expert forward) | auto "
                                "(gather, or ring where the memory plan finds only it fits, or with less remat)",
                                choices=EXPERT_DISPATCHES)

    @property
    def compute_dtype(self) -> Any:
        return DTYPES[self.dtype]

    def run_choices(self) -> dict[str, Any]:
        """The `ModelConfig` fields this section sets beside the checkpoint's (how, not what, the model computes)."""
        return dict(moe_impl=self.moe_impl, expert_parallel=self.expert_parallel, expert_dispatch=self.expert_dispatch)

    @property
    def storage_dtype(self) -> Any:
        return DTYPES[self.param_dtype]


def _state_path(keypath: tuple[Any, ...]) -> tuple[str | int, ...]:
    return tuple(k.key for k in keypath if isinstance(k, jax.tree_util.DictKey))


_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))


class _Reader:
    """Finds which safetensors file holds each tensor of a checkpoint directory and reads them."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as fh:
                weight_map = json.load(fh).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index!r} has no 'weight_map' dictionary; it is not a safetensors index.")
            for file in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(path, file)):
                    raise FileNotFoundError(f"{os.path.join(path, file)!r} is listed in {index!r} but missing; "
                                            "copy the complete checkpoint.")
            self.weight_map = dict(weight_map)
        else:
            files = [os.path.join(path, SINGLE_FILE)] if os.path.isfile(os.path.join(path, SINGLE_FILE)) else sorted(
                glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"No {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file in {path!r}; "
                                        "only safetensors checkpoints are supported (convert *.bin files first).")
            self.weight_map = {}
            for file in files:
                with safe_open(file, framework="numpy") as fh:
                    for key in fh.keys():
                        self.weight_map[key] = os.path.basename(file)
        self._handles: dict[str, Any] = {}
        self._held: tuple[str | None, Any] = (None, None)  # the last whole tensor `read` kept
        self.fp8_block = None  # (rows, columns) of a block-scaled fp8 checkpoint's blocks (models.fp8)
        if os.path.isfile(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as fh:
                self.fp8_block = fp8.block_size(json.load(fh))
        # An image-and-text checkpoint (Gemma 3 4B and up) holds its decoder under a prefix: the hub's
        # language_model.model.* / language_model.lm_head.*, or model.language_model.* as transformers names it in
        # memory. Those tensors answer to the text model's own names; the vision tower's are never read.
        self.names = {name: name for name in self.weight_map}
        for name in self.weight_map:
            for prefix, ours in _TEXT_PREFIXES:
                if name.startswith(prefix):
                    self.names.setdefault(ours + name[len(prefix):], name)
        disk_names.add_aliases(self.names)

    def _mxfp4(self, name: str) -> bool:
        """Whether `name` is stored as MXFP4 blocks and scales (gpt-oss's experts) instead of itself."""
        return name not in self.names and all(name + s in self.names for s in MXFP4_SUFFIXES)

    def _fp8(self, name: str) -> bool:
        """Whether `name` is stored as block-scaled fp8 (models.fp8) instead of itself."""
        return self.fp8_block is not None and name in self.names and name + fp8.SCALE_SUFFIX in self.names

    def has(self, name: str) -> bool:
        return name in self.names or self._mxfp4(name) or stacked_experts.source(name, self.names) is not None or \
            disk_names.parts(name, self.names) is not None

    def file_of(self, name: str) -> str:
        name = (disk_names.parts(name, self.names) or (name,))[0]
        stacked = stacked_experts.source(name, self.names)
        name = stacked[0] if stacked else name + "_blocks" if self._mxfp4(name) else name
        return os.path.join(self.path, self.weight_map[self.names[name]])

    def shape(self, name: str) -> tuple[int, ...]:
        if self._mxfp4(name):  # blocks [..., R, G, 16] hold the tensor [..., G * 32, R]
            *lead, rows, groups, _ = self.shape(name + "_blocks")
            return (*lead, groups * 32, rows)
        stacked = stacked_experts.source(name, self.names)  # one expert's part of Qwen3-VL-MoE's stacked tensors
        if stacked:
            return stacked_experts.shape(stacked[2], self.shape(stacked[0]))
        if disk_names.parts(name, self.names):  # the concatenation of several (OLMo Hybrid's conv1d)
            shapes = [self.shape(p) for p in disk_names.parts(name, self.names)]
            return (sum(s[0] for s in shapes), *shapes[0][1:])
        return tuple(self._handle(name).get_slice(self.names[name]).get_shape())

    def read(self, name: str, rows: tuple[int, ...] | None = None, axis: int = 0, keep: bool = False) -> np.ndarray:
        """The tensor, or its rows[0]..rows[1] along `axis` (one part of a fused tensor); an MXFP4 or fp8 one
        dequantised. That one, or with `keep` any, is kept whole for the next part that reads it (Qwen3-Next's
        in_proj_qkvz / in_proj_ba, each of whose parts takes rows of its own from the whole tensor)."""
        if disk_names.parts(name, self.names):
            whole = np.concatenate([self.read(p) for p in disk_names.parts(name, self.names)])
            return whole if rows is None else whole[(slice(None),) * axis + (slice(rows[0], rows[1]),)]
        stacked = stacked_experts.source(name, self.names)
        if stacked:
            whole = stacked_experts.take(stacked[2], self._handle(stacked[0]).get_slice(self.names[stacked[0]])[stacked[1]])
            return whole if rows is None else whole[(slice(None),) * axis + (slice(rows[0], rows[1]),)]
        quantised = self._mxfp4(name) or self._fp8(name)
        if quantised or keep:
            if self._held[0] != name:
                self._held = (name, self._dequantize(name) if quantised else
                              self._handle(name).get_tensor(self.names[name]))
            whole = self._held[1]
            return whole if rows is None else whole[(slice(None),) * axis + (slice(rows[0], rows[1]),)]
        if rows is None:
            return self._handle(name).get_tensor(self.names[name])
        return self._handle(name).get_slice(self.names[name])[(slice(None),) * axis + (slice(rows[0], rows[1]),)]

    def _dequantize(self, name: str) -> np.ndarray:
        """The whole float32 tensor of a quantised `name` (MXFP4 or block-scaled fp8)."""
        if self._fp8(name):
            raw = fp8.read_raw(self.file_of(name), self.names[name])
            return fp8.dequantize_blocks(raw, self.read(name + fp8.SCALE_SUFFIX), self.fp8_block)
        return dequantize_mxfp4(*(self.read(name + s) for s in MXFP4_SUFFIXES))

    def _handle(self, name: str) -> Any:
        file = self.file_of(name)
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="numpy")
        return self._handles[file]


def load_hf_checkpoint(path: str | os.PathLike, *, mesh: Mesh | None = None, param_dtype: Any = jnp.float32,
                       dtype: Any = None, max_len: int | None = None, moe_impl: str | None = None,
                       expert_parallel: bool = True, expert_dispatch: str = "auto") -> Transformer:
    """Loads an HF checkpoint directory of a supported family (models.hf_config) into a Transformer (of an
    image-and-text Gemma 3 checkpoint, its text decoder; saving it writes a text-only Gemma3ForCausalLM).
    max_len: the longest sequence the run holds, which picks LongRoPE's factors (`ModelConfig.for_sequence_length`;
    None: the short ones). moe_impl: a mixture of experts' computation (`ModelConfig.moe_impl`; None: "auto");
    expert_parallel, expert_dispatch: `ModelConfig`'s (where its experts live on a train mesh, how tokens reach them).

    param_dtype: storage dtype of the parameters (tensors are cast on the host); dtype: compute dtype
    (default: param_dtype). With a mesh, each parameter is built directly as a sharded array
    (`logical_to_mesh_sharding`), one tensor at a time, never whole on one device.
    """
    path = os.fspath(path)
    cfg = ModelConfig.from_pretrained(path, dtype=param_dtype if dtype is None else dtype, param_dtype=param_dtype)
    if max_len is not None:
        cfg = cfg.for_sequence_length(max_len)
    if moe_impl is not None:
        cfg = cfg.replace(moe_impl=moe_impl)
    cfg = cfg.replace(expert_parallel=expert_parallel, expert_dispatch=expert_dispatch)
    reader = _Reader(path)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    shardings = logical_to_mesh_sharding(abs_state, mesh) if mesh is not None else None
    by_path: dict[tuple, list[_Entry]] = {}
    for e in weight_entries(cfg):
        by_path.setdefault(e.path, []).append(e)
    sharding_leaves = {}
    if shardings is not None:
        for keypath, s in jax.tree_util.tree_flatten_with_path(shardings)[0]:
            sharding_leaves[_state_path(keypath)] = s

    def load(keypath: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        spath = _state_path(keypath)
        entries = by_path.get(spath)
        if entries is None:
            raise RuntimeError(f"Parameter {'/'.join(map(str, spath))} has no HF tensor mapping.")
        parts = []
        for entry in entries:  # one, or one per expert
            if not reader.has(entry.hf_name):
                raise KeyError(f"Tensor {entry.hf_name!r} is missing from the checkpoint in {path!r}; config.json "
                               f"describes a {cfg.architecture} model that needs it.")
            got, want = reader.shape(entry.hf_name), entry.fused_shape(tuple(leaf.shape))
            if got != want:
                raise ValueError(f"Tensor {entry.hf_name!r} in {reader.file_of(entry.hf_name)!r} has shape {got}, "
                                 f"but config.json implies {want}; the weights do not match the config.")
            hf = reader.read(entry.hf_name, entry.rows, entry.row_axis, keep=entry.gather is not None)
            parts.append(entry.to_ours(hf, tuple(leaf.shape)).astype(cfg.param_dtype))
        host = parts[0] if entries[0].expert is None else np.stack(parts)
        if shardings is None:
            return jnp.asarray(host)
        sharding = sharding_leaves[spath]
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: np.require(host[idx], requirements="C"))

    state = jax.tree_util.tree_map_with_path(load, abs_state)
    return nnx.merge(graphdef, state)


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _plan_shards(sizes: list[int], max_shard_size: int | None) -> list[list[int]]:
    """Groups tensor indices, in order, into shards of at most max_shard_size bytes (a larger tensor alone)."""
    if max_shard_size is None or sum(sizes) <= max_shard_size:
        return [list(range(len(sizes)))]
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


def _hf_layout(model: Transformer, dtype: Any) -> tuple[dict, list[list[_Entry]], dict, np.dtype, list[int]]:
    """(config.json dictionary, the HF tensors as groups of table entries (one entry each, or a fused tensor's
    parts in row order), the model's parameters by path, dtype on disk, bytes per HF tensor)."""
    cfg: ModelConfig = model.cfg
    save_dtype = jnp.dtype(cfg.param_dtype if dtype is None else dtype)
    hf_config = cfg.to_hf_dict()
    hf_config["dtype"] = save_dtype.name
    entries = weight_entries(cfg)
    flat = {_state_path(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}
    missing = [e.path for e in entries if e.path not in flat]
    if missing:
        raise ValueError(f"Model state lacks parameters {missing}; it does not match its config.")
    groups: dict[str, list[_Entry]] = {}
    for e in entries:
        groups.setdefault(e.hf_name, []).append(e)
    sizes = [sum(int(np.prod(e.hf_shape(tuple(flat[e.path].shape)))) for e in g) * save_dtype.itemsize
             for g in groups.values()]
    return hf_config, list(groups.values()), flat, save_dtype, sizes


def _hf_tensor(group: list[_Entry], flat: dict, save_dtype: Any, held: dict | None = None,
               keep: int = 1) -> np.ndarray:
    """One HF tensor on the host: its entry's parameter in HF's layout, or a fused tensor's parts stacked, or one
    expert's slice. held: the last `keep` parameters fetched to the host, kept for the next experts' slices of them
    (a reader that takes expert j's gate, up and down before expert j + 1's keeps three)."""
    held = {} if held is None else held

    def host(e: _Entry) -> np.ndarray:
        if e.expert is None:
            return _to_host(flat[e.path])
        if e.path not in held:
            while len(held) >= keep:
                held.pop(next(iter(held)))
            held[e.path] = _to_host(flat[e.path])
        return held[e.path][e.expert]

    parts = [e.to_hf(host(e).astype(save_dtype)) for e in group]
    if group[0].gather is not None:  # Qwen3-Next's fused projections: each part's rows at their own places
        whole = np.empty((group[0].gather, *parts[0].shape[1:]), parts[0].dtype)
        for e, part in zip(group, parts):
            whole[np.asarray(e.channels)] = part
        return whole
    if group[0].interleave is not None:  # gpt-oss's gate_up_proj: the parts alternate along the last axis
        return np.ascontiguousarray(np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1))
    whole = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=group[0].row_axis)
    return np.require(whole, requirements="C")  # (np.ascontiguousarray would make a 0-d tensor 1-d: Apertus' beta, eps)


def _write_files(path: str, hf_config: dict, names: list[str], sizes: list[int], tensor, writer: bool,
                 max_shard_size: int | None) -> None:
    """Writes config.json and the safetensors file(s) of `names` (tensor(i): the i-th one on the host, called
    on every process in order: gathers may need all of them), one shard in memory at a time."""
    plan = _plan_shards(sizes, max_shard_size)
    if writer:
        os.makedirs(path, exist_ok=True)
        for stale in [INDEX_FILE, SINGLE_FILE] + [f for f in os.listdir(path) if _SHARD_PATTERN.fullmatch(f)]:
            if os.path.isfile(os.path.join(path, stale)):
                os.remove(os.path.join(path, stale))
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump(hf_config, fh, indent=2, sort_keys=True)
    weight_map: dict[str, str] = {}
    for n, group in enumerate(plan):
        file = SINGLE_FILE if len(plan) == 1 else f"model-{n + 1:05d}-of-{len(plan):05d}.safetensors"
        tensors = {}
        for i in group:
            tensors[names[i]] = tensor(i)
            weight_map[names[i]] = file
        if writer:
            save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    if writer and len(plan) > 1:
        with open(os.path.join(path, INDEX_FILE), "w") as fh:
            json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, fh, indent=2,
                      sort_keys=True)


def save_hf_checkpoint(model: Transformer, path: str | os.PathLike, *, max_shard_size: int | None = None,
                       dtype: Any = None) -> None:
    """Writes `model` as an HF checkpoint directory that transformers' from_pretrained loads.

    Files: config.json and model.safetensors, or, when the weights exceed max_shard_size bytes,
    model-0000i-of-0000n.safetensors plus model.safetensors.index.json. dtype: tensor dtype on disk
    (default: the model's param_dtype). Sharded and multi-host arrays are gathered one tensor at a time;
    only process 0 writes.
    """
    hf_config, groups, flat, save_dtype, sizes = _hf_layout(model, dtype)
    held: dict = {}
    _write_files(os.fspath(path), hf_config, [g[0].hf_name for g in groups], sizes,
                 lambda i: _hf_tensor(groups[i], flat, save_dtype, held), jax.process_index() == 0, max_shard_size)


@dataclass(frozen=True)
class HostCheckpoint:
    """An HF checkpoint held in host memory (`host_checkpoint`), to be written later, e.g. by another thread."""

    config: dict
    names: list[str]
    tensors: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def write(self, path: str | os.PathLike, max_shard_size: int | None = None) -> None:
        """The checkpoint directory, as `save_hf_checkpoint` writes it."""
        _write_files(os.fspath(path), self.config, self.names, [t.nbytes for t in self.tensors],
                     lambda i: self.tensors[i], True, max_shard_size)


def host_checkpoint(model: Transformer, dtype: Any = None) -> HostCheckpoint:
    """Every tensor of `model` copied to the host in HF's layout and `dtype` (default: its param_dtype), with
    its config.json: a snapshot the model's later updates do not change. Every process must call it
    (multi-host arrays are gathered)."""
    hf_config, groups, flat, save_dtype, _ = _hf_layout(model, dtype)
    held: dict = {}
    tensors = [_hf_tensor(g, flat, save_dtype, held) for g in groups]
    return HostCheckpoint(hf_config, [g[0].hf_name for g in groups], tensors)


def read_safetensors_dir(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (single file or sharded) as host arrays, by HF name."""
    reader = _Reader(os.fspath(path))
    return {name: reader.read(name) for name in sorted(reader.weight_map)}

