"""LoRA adapters in the PEFT layout: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base_model, DIR)` loads onto the HF base model.

Layout: PEFT keeps nn.Linear's [out, in] convention, lora_A.weight [r, in] and lora_B.weight [out, r], named
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`; here A is [*in, r] and B [r, *out]
(q_proj A [D, r], B [r, H, Dh]; o_proj A [H, Dh, r], B [r, D]), so each tensor is a reshape and a transpose.
PEFT's scale is lora_alpha / r, the same as ours.

Phi (phi3) fuses q/k/v into one qkv_proj and gate/up into one gate_up_proj (GLM-4 the latter); Qwen3-Next fuses its
Gated DeltaNet's in_qkv and in_z into one in_proj_qkvz and in_b, in_a into one in_proj_ba, their rows interleaved key
head by key head. The adapters of a fused module's n adapted parts are written as one adapter of rank n * r: A stacks
the parts' A, B places each part's B in its own rows (where the HF weight holds that part's rows) and rank columns
(zeros elsewhere), and rank_pattern / lora_alpha_pattern give that module rank n * r and alpha n * alpha, so its
scale stays alpha / r and its update is exactly the parts' updates side by side.

A mixture of experts' expert adapters (lora.targets "experts") go to transformers' stacked expert parameters through
PEFT's target_parameters (`peft_experts`).

Over an image-and-text base (Gemma 3 4B and up, Mistral 3, Qwen3.5, Qwen3-VL, LFM2-VL, LFM3-VL: `decoder_layers`) transformers holds the
decoder's layers at model.language_model.layers, so the adapters are named there; a PEFT directory named either way
loads.
"""
from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from areal_jax.models.disk_names import in_memory
from areal_jax.models.hf_names import weight_entries
from areal_jax.models.lora import PROJECTIONS, LoRAConfig, LoRAProjection, module_at
from areal_jax.models.peft_experts import expert_config, expert_groups, expert_tensors, load_expert_tensors
from areal_jax.models.wrapped_export import wrapper_type

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def _adapted(model: nnx.Module) -> list[tuple[int, str, LoRAProjection]]:
    out = []
    for i, layer in enumerate(model.layers):
        for short, (part, attr, _) in PROJECTIONS.items():
            node = getattr(module_at(layer, part), attr, None)  # None: a mixture of experts' MLP, no shared one
            if isinstance(node, LoRAProjection):
                out.append((i, short, node))
    if not out and not expert_groups(model):
        raise ValueError("The model has no LoRA adapters to save; apply models.lora.apply_lora first.")
    dense_mlp = sorted({f"layers.{i}.{PROJECTIONS[short][0]}.{PROJECTIONS[short][1]}" for i, short, _ in out
                        if PROJECTIONS[short][0].startswith("mlp")})
    out_proj = sorted(f"layers.{i}.linear_attn.out_proj" for i, short, _ in out if short == "out")
    if out_proj and getattr(model.cfg, "architecture", None) in _MAMBA_OUT_REFUSED:
        raise ValueError(f"PEFT refuses adapters on a Mamba-2 mixer's out_proj in {model.cfg.architecture} models "
                         f"({', '.join(out_proj[:4])}{' ...' if len(out_proj) > 4 else ''}); export the merged checkpoint "
                         "(export --format=hf), or leave 'out' out of lora.targets (e.g. q,k,v,o,in_z,in_xbc,in_dt,up,down).")
    if dense_mlp and getattr(model.cfg, "architecture", None) in _EXPERT_NAMED_MLP:
        raise ValueError(f"PEFT (on transformers 5) reads a target ending in gate_proj / up_proj / down_proj of a "
                         f"{model.cfg.architecture} model as its experts' parameters, so the adapters of its dense "
                         f"MLPs ({', '.join(dense_mlp)}) cannot be written as PEFT loads them; export the "
                         "merged checkpoint (export --format=hf), or adapt attention and experts only "
                         "(lora.targets=attn,experts).")
    return out


_MAMBA_OUT_REFUSED = ("nemotron_h", "falcon_h1", "mamba", "falcon_mamba", "mamba2")  # peft's own check refuses out_proj targets in these model types
# mixtures of experts whose dense MLPs' names (their dense layers', their shared experts') PEFT maps onto the experts
# (transformers' qwen2_moe conversion); Qwen2-MoE's and Qwen3.5-MoE's shared experts load as named
_EXPERT_NAMED_MLP = ("qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1", "ernie4_5_moe",
                     "qwen3_next", "exaone_moe", "hunyuan_v1_moe")


def module_name(cfg: Any, layer: int, short: str) -> str:
    """HF module path of a projection as transformers' module holds it, e.g. (0, "q") -> "model.layers.0.self_attn.q_proj",
    off the HF weight table: Phi's "model.layers.0.self_attn.qkv_proj" (fused), a shared expert's as its family names
    it, LFM2's "model.layers.0.conv.in_proj"."""
    return _modules(cfg)[(layer, short)][0]


@functools.lru_cache(maxsize=8)
def _modules(cfg: Any) -> dict[tuple[int, str], tuple[str, tuple[np.ndarray, int] | None]]:
    """{(layer, projection): (its HF module path, and where that module fuses several of ours (Phi's qkv_proj, GLM-4's
    gate_up_proj, Qwen3-Next's in_proj_qkvz, Granite 4.0's input_linear, a Mamba-2 in_proj, whose x B C rows are
    regrouped too): the rows of the fused weight that hold its rows, in our order, and that weight's rows)}, read off
    the HF weight table once per config."""
    short_of = {(part, attr): short for short, (part, attr, _) in PROJECTIONS.items()}
    out = {}
    for e in weight_entries(cfg):
        short = short_of.get((".".join(map(str, e.path[2:-1])), e.path[-1])) if e.path[0] == "layers" else None
        if short is None or e.expert is not None:
            continue
        rows = (np.asarray(e.channels), e.gather) if e.gather is not None else None if e.rows is None else \
            (e.rows[0] + (np.arange(e.rows[1] - e.rows[0]) if e.channels is None else np.asarray(e.channels)), e.rows[2])
        out[(e.path[1], short)] = (in_memory(e.hf_name, cfg.architecture).removesuffix(".weight"), rows)
    return out


def _groups(model: nnx.Module) -> list[tuple[str, int, list[tuple[str, LoRAProjection]]]]:
    """(HF module path, its layer, its adapted parts [(short, adapter)] in row order) for every adapted HF module."""
    out: dict[tuple[str, int], list[tuple[str, LoRAProjection]]] = {}
    for i, short, node in _adapted(model):
        out.setdefault((module_name(model.cfg, i, short), i), []).append((short, node))
    return [(module, i, parts) for (module, i), parts in out.items()]


def peft_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every adapter as PEFT names it: {...q_proj.lora_A.weight: [r, in], ...lora_B.weight: [out, r]} float32
    (a fused module's: rank n * r, see the module docstring; the experts': `peft_experts.expert_tensors`)."""
    tensors, orders = expert_tensors(model), _hf_orders(model.cfg)
    for module, layer, parts in _groups(model):
        a_rows, b_cols = [], []
        for _, node in parts:
            a = np.asarray(jax.device_get(node.lora_a[...]), np.float32)
            b = np.asarray(jax.device_get(node.lora_b[...]), np.float32)
            r = a.shape[-1]
            a_rows.append(a.reshape(-1, r).T)
            b_cols.append(b.reshape(r, -1).T)
        name = f"base_model.model.{module}"
        tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(np.concatenate(a_rows, axis=0))
        fused = _modules(model.cfg)[(layer, parts[0][0])][1]
        if fused is None:
            order = orders.get(parts[0][0])
            if order is not None:  # B's rows in HF's order of the base's outputs
                b_cols[0] = b_cols[0][np.argsort(order)]
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b_cols[0])
            continue
        total, r = fused[1], a_rows[0].shape[0]
        b = np.zeros((total, r * len(parts)), np.float32)
        for j, ((short, _), col) in enumerate(zip(parts, b_cols)):
            b[_modules(model.cfg)[(layer, short)][1][0], j * r:(j + 1) * r] = col
        tensors[f"{name}.lora_B.weight"] = b
    return tensors


_LAYERS, _WRAPPED_LAYERS = "model.layers.", "model.language_model.layers."


def decoder_layers(base: str) -> str:
    """Where transformers holds the decoder's layers in the base model at directory `base`: "model.layers.", or
    "model.language_model.layers." for an image-and-text checkpoint (`wrapped_export.wrapper_type`; and where `base`
    has no readable config.json, the former)."""
    return _WRAPPED_LAYERS if base and wrapper_type(base) else _LAYERS


def _relocate(obj: Any, old: str, new: str) -> Any:
    """`obj` (a name, a regex of PEFT's patterns, or a list / dict of them) with the decoder's layers at `new`."""
    if isinstance(obj, str):
        return obj.replace(old, new).replace(re.escape(old), re.escape(new))
    if isinstance(obj, list):
        return [_relocate(x, old, new) for x in obj]
    if isinstance(obj, dict):
        return {_relocate(k, old, new): v for k, v in obj.items()}
    return obj


def save_peft_adapter(model: nnx.Module, cfg: LoRAConfig, path: str | os.PathLike, *,
                      base_model_name_or_path: str = "") -> str:
    """Write the model's adapters as a PEFT LoRA directory at `path`; returns the path.

    target_modules lists the short projection names when every layer adapts the same ones and no other module of the
    decoder ends in those names (Granite 4.0's experts are block_sparse_moe.input_linear beside its shared MLP's
    shared_mlp.input_linear), else the full module paths (PEFT matches a list entry against the end of each module
    name). Over an image-and-text base
    (`decoder_layers` of base_model_name_or_path) every name is under model.language_model."""
    path = os.fspath(path)
    groups = _groups(model)
    by_layer: dict[int, set[str]] = {}
    for module, layer, _ in groups:
        by_layer.setdefault(layer, set()).add(module.rsplit(".", 1)[1])
    sets = {frozenset(v) for v in by_layer.values()}
    others = {in_memory(e.hf_name, model.cfg.architecture).rsplit(".", 1)[0] for e in weight_entries(model.cfg)} - \
        {module for module, _, _ in groups}
    if len(by_layer) == model.cfg.num_layers and len(sets) == 1 and \
            not any(m.rsplit(".", 1)[-1] in next(iter(sets)) for m in others):
        targets = sorted(next(iter(sets)))
    else:
        targets = [module for module, _, _ in groups]
    wide = {re.escape(module): len(parts) for module, _, parts in groups if len(parts) > 1}  # fused: rank n * r
    experts = expert_config(model, cfg.rank, cfg.alpha)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": targets or None,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {**{k: n * cfg.rank for k, n in wide.items()}, **experts["rank_pattern"]},
        "alpha_pattern": {**{k: n * cfg.alpha for k, n in wide.items()}, **experts["alpha_pattern"]},
    }
    if experts["target_parameters"]:
        config["target_parameters"] = experts["target_parameters"]
    tensors, layers = peft_tensors(model), decoder_layers(base_model_name_or_path)
    if layers != _LAYERS:
        config = {k: _relocate(v, _LAYERS, layers) if k != "base_model_name_or_path" else v for k, v in config.items()}
        tensors = _relocate(tensors, _LAYERS, layers)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def load_peft_adapter(model: nnx.Module, path: str | os.PathLike) -> nnx.Module:
    """Read a PEFT LoRA directory's tensors into an adapted model of the same shape (in place); returns it."""
    path = os.fspath(path)
    with open(os.path.join(path, CONFIG_FILE)) as fh:
        config: dict[str, Any] = json.load(fh)
    tensors = _relocate(load_file(os.path.join(path, WEIGHTS_FILE)), _WRAPPED_LAYERS, _LAYERS)
    saved = peft_tensors(model)  # where each part's rows and rank columns sit in this model's layout
    for _, _, _, parts in expert_groups(model):
        _check_rank(config, path, parts[0][1].lora_a.shape[-1], parts[0][1].scale)
    load_expert_tensors(model, tensors, path)
    orders = _hf_orders(model.cfg)
    for module, layer, parts in _groups(model):
        name = f"base_model.model.{module}"
        if f"{name}.lora_A.weight" not in tensors or tensors[f"{name}.lora_A.weight"].shape != \
                saved[f"{name}.lora_A.weight"].shape:
            raise KeyError(f"{path} has no adapter for {module} of this model's rank and parts; it was saved for "
                           f"other targets ({config.get('target_modules')}) or another rank.")
        a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
        for j, (short, node) in enumerate(parts):
            r, rows = node.lora_a.shape[-1], _modules(model.cfg)[(layer, short)][1]
            _check_rank(config, path, r, node.scale)
            part = b[rows[0] if rows is not None else slice(None), j * r:(j + 1) * r]
            order = orders.get(short)
            node.lora_a.set_value(jnp.asarray(a[j * r:(j + 1) * r].T.reshape(node.lora_a.shape), node.lora_a.dtype))
            node.lora_b.set_value(jnp.asarray((part if order is None else part[order]).T.reshape(node.lora_b.shape),
                                              node.lora_b.dtype))
    return model


@functools.lru_cache(maxsize=8)
def _hf_orders(cfg: Any) -> dict[str, np.ndarray]:
    """{projection: where each of our output rows lies in HF's weight} for the projections whose rows the HF weight
    table regroups but does not fuse with others (`hf_names._Entry.channels`: the Gated DeltaNet's in_proj_qkv, held key
    head by key head here; every layer's the same); the others' rows are HF's own order."""
    short_of = {attr: short for short, (part, attr, _) in PROJECTIONS.items() if part == "linear_attn"}
    return {short_of[e.path[-1]]: np.asarray(e.channels) for e in weight_entries(cfg)
            if e.path[-1] in short_of and e.channels is not None and e.gather is None and e.rows is None}


def _check_rank(config: dict[str, Any], path: str, r: int, scale: float) -> None:
    if config.get("r") != r or abs(float(config.get("lora_alpha")) / r - scale) > 1e-12:
        raise ValueError(f"{path} holds r={config.get('r')}, lora_alpha={config.get('lora_alpha')}; the "
                         f"model's adapters have rank {r} and scale {scale}.")
