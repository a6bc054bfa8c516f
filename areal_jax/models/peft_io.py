"""LoRA adapters in the PEFT layout: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base_model, DIR)` loads onto the HF base model.

Layout: PEFT keeps nn.Linear's [out, in] convention, lora_A.weight [r, in] and lora_B.weight [out, r], named
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`; here A is [*in, r] and B [r, *out]
(q_proj A [D, r], B [r, H, Dh]; o_proj A [H, Dh, r], B [r, D]), so each tensor is a reshape and a transpose.
PEFT's scale is lora_alpha / r, the same as ours.
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from areal_jax.models.lora import PROJECTIONS, LoRAConfig, LoRAProjection

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_HF_PART = {"attn": "self_attn", "mlp": "mlp"}


def _adapted(model: nnx.Module) -> list[tuple[int, str, LoRAProjection]]:
    out = []
    for i, layer in enumerate(model.layers):
        for short, (part, attr, _) in PROJECTIONS.items():
            node = getattr(getattr(layer, part), attr)
            if isinstance(node, LoRAProjection):
                out.append((i, short, node))
    if not out:
        raise ValueError("The model has no LoRA adapters to save; apply models.lora.apply_lora first.")
    return out


def module_name(layer: int, short: str) -> str:
    """HF module path of a projection, e.g. (0, "q") -> "model.layers.0.self_attn.q_proj"."""
    part, attr, _ = PROJECTIONS[short]
    return f"model.layers.{layer}.{_HF_PART[part]}.{attr}"


def peft_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every adapter as PEFT names it: {...q_proj.lora_A.weight: [r, in], ...lora_B.weight: [out, r]} float32."""
    tensors = {}
    for i, short, node in _adapted(model):
        a = np.asarray(jax.device_get(node.lora_a[...]), np.float32)
        b = np.asarray(jax.device_get(node.lora_b[...]), np.float32)
        r = a.shape[-1]
        name = f"base_model.model.{module_name(i, short)}"
        tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
        tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
    return tensors


def save_peft_adapter(model: nnx.Module, cfg: LoRAConfig, path: str | os.PathLike, *,
                      base_model_name_or_path: str = "") -> str:
    """Write the model's adapters as a PEFT LoRA directory at `path`; returns the path.

    target_modules lists the short projection names when every layer adapts the same ones, else the full
    module paths (PEFT matches a list entry against the end of each module name)."""
    path = os.fspath(path)
    adapted = _adapted(model)
    by_layer: dict[int, set[str]] = {}
    for i, short, _ in adapted:
        by_layer.setdefault(i, set()).add(short)
    sets = {frozenset(v) for v in by_layer.values()}
    if len(by_layer) == model.cfg.num_layers and len(sets) == 1:
        targets = sorted(PROJECTIONS[s][1] for s in next(iter(sets)))
    else:
        targets = [module_name(i, s) for i, s, _ in adapted]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    save_file(peft_tensors(model), os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def load_peft_adapter(model: nnx.Module, path: str | os.PathLike) -> nnx.Module:
    """Read a PEFT LoRA directory's tensors into an adapted model of the same shape (in place); returns it."""
    path = os.fspath(path)
    with open(os.path.join(path, CONFIG_FILE)) as fh:
        config: dict[str, Any] = json.load(fh)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    for i, short, node in _adapted(model):
        name = f"base_model.model.{module_name(i, short)}"
        if f"{name}.lora_A.weight" not in tensors:
            raise KeyError(f"{path} has no adapter for {module_name(i, short)}; it was saved for other targets "
                           f"({config.get('target_modules')}).")
        r = node.lora_a.shape[-1]
        if config.get("r") != r or abs(float(config.get("lora_alpha")) / r - node.scale) > 1e-12:
            raise ValueError(f"{path} holds r={config.get('r')}, lora_alpha={config.get('lora_alpha')}; the model's "
                             f"adapters have rank {r} and scale {node.scale}.")
        node.lora_a.set_value(tensors[f"{name}.lora_A.weight"].T.reshape(node.lora_a.shape))
        node.lora_b.set_value(tensors[f"{name}.lora_B.weight"].T.reshape(node.lora_b.shape))
    return model
