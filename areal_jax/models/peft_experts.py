"""Expert adapters (`lora.LoRAExperts`) in PEFT's layout for transformers' stacked expert parameters.

transformers (5.x) keeps a mixture-of-experts layer's experts as two 3-D parameters of one module,
`model.layers.{i}.mlp.experts` (Granite 3 MoE: `block_sparse_moe.experts`): gate_up_proj [E, 2F, D] (each expert's
gate rows, then its up rows) and down_proj [E, D, F]. PEFT adapts such parameters through `target_parameters`
(its ParamWrapper): one adapter per parameter, every expert's factors in two tensors,

    lora_A.weight [E * R, in]: row e * R + j is column j of expert e's A (R the adapter's rank),
    lora_B.weight [out, R * E]: column j * E + e is row j of expert e's B,

and expert e's update scaling * (A_e @ B_e)^T. With both parameters of a module adapted, PEFT nests the wrappers in
the module's parameter order, so gate_up_proj's tensors sit under `experts.base_layer.` and down_proj's under
`experts.`. Our gate and up adapters (each rank r) share the fused parameter: they are written as one adapter of
rank n * r for the n adapted parts (A stacked, B block-diagonal), with rank_pattern / alpha_pattern keeping the
scale alpha / r, as for Phi's fused modules (`peft_io`). gpt-oss stores its experts the other way round,
gate_up_proj [E, D, 2F] with gate and up interleaved along the last axis; PEFT reads its in and out dimensions
accordingly, so the tensors are the same but B's rows of gate and up alternate. Nemotron-H's ungated experts are
up_proj [E, F, D] and down_proj [E, D, F] of the experts block after each layer's mixer block.
"""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.lora import LoRAExperts

PARAMS = {"gate_up_proj": ("experts_gate", "experts_up"), "down_proj": ("experts_down",)}  # transformers' order
UNGATED_PARAMS = {"up_proj": ("experts_up",), "down_proj": ("experts_down",)}  # Nemotron-H's ungated experts'


def _params(model_or_cfg: Any) -> dict[str, tuple[str, ...]]:
    """transformers' stacked expert parameters of this model, each with the parts of ours it holds, in its order."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    return PARAMS if cfg.gated_mlp else UNGATED_PARAMS


def experts_module(model_or_cfg: Any, layer: int) -> str:
    """transformers' module path of layer `layer`'s experts (Nemotron-H's: its experts block, after the layer's
    mixer block)."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    if getattr(cfg, "architecture", None) == "nemotron_h":
        from areal_jax.models.nemotron_h import first_blocks  # noqa: PLC0415

        return f"model.layers.{first_blocks(cfg)[layer] + 1}.mixer.experts"
    from areal_jax.models.hf_names import layout_of  # noqa: PLC0415 (it imports every family)

    arch = getattr(cfg, "architecture", None)
    block = "block_sparse_moe" if arch and layout_of(arch).experts == "stacked" else \
        {"lfm2_moe": "feed_forward", "jamba": "feed_forward"}.get(arch, "mlp")
    return f"model.layers.{layer}.{block}.experts"


def expert_groups(model: nnx.Module) -> list[tuple[str, str, int, list[tuple[str, LoRAExperts]]]]:
    """(parameter key, tensor-name prefix, our layer, adapted parts [(ours, adapter)] in row order) for every adapted
    stacked expert parameter, e.g. ("model.layers.0.mlp.experts.gate_up_proj",
    "base_model.model.model.layers.0.mlp.experts.base_layer", 0, [("experts_gate", ...), ("experts_up", ...)])."""
    out = []
    for i, layer in enumerate(model.layers):
        moe = layer.mlp
        found = {param: [(name, getattr(moe, name)) for name in parts
                         if isinstance(getattr(moe, name, None), LoRAExperts)] for param, parts in _params(model).items()}
        found = {param: parts for param, parts in found.items() if parts}
        module = experts_module(model, i)
        for k, (param, parts) in enumerate(found.items()):
            nested = ".base_layer" * (len(found) - 1 - k)  # the first-wrapped parameter lies innermost
            out.append((f"{module}.{param}", f"base_model.model.{module}{nested}", i, parts))
    return out


def _rows(moe: Any, parts: tuple[str, ...], interleaved: bool) -> tuple[int, dict[str, np.ndarray]]:
    """(the out dimension's size, {ours: its indices there}) of each of a stacked parameter's `parts`: one after
    another, or `interleaved` (gpt-oss's gate_up_proj: gate at even columns, up at odd ones)."""
    widths = [getattr(moe, name).shape[2] for name in parts]
    total, n = sum(widths), len(widths)
    if interleaved:
        return total, {name: np.arange(j, total, n) for j, name in enumerate(parts)}
    starts = np.cumsum([0] + widths)
    return total, {name: np.arange(starts[j], starts[j + 1]) for j, name in enumerate(parts)}


def _fused_parts(model: nnx.Module, adapted: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Every part (adapted or not) of the stacked parameter that holds the `adapted` parts, in its order."""
    return [(name, None) for name in next(p for p in _params(model).values() if adapted[0][0] in p)]


def _interleaved(model: nnx.Module) -> bool:
    return getattr(model.cfg, "architecture", None) == "gpt_oss"


def expert_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every expert adapter as PEFT names it (float32); see the module docstring."""
    tensors = {}
    for _, prefix, layer, parts in expert_groups(model):
        total, rows = _rows(model.layers[layer].mlp, tuple(name for name, _ in _fused_parts(model, parts)),
                            _interleaved(model))
        a = np.concatenate([np.asarray(jax.device_get(node.lora_a[...]), np.float32).transpose(0, 2, 1)
                            for _, node in parts], axis=1)  # [E, R, in]
        e, rank = a.shape[:2]
        r = rank // len(parts)
        b = np.zeros((e, rank, total), np.float32)  # [E, R, out]
        for p, (name, node) in enumerate(parts):
            b[:, p * r:(p + 1) * r, rows[name]] = np.asarray(jax.device_get(node.lora_b[...]), np.float32)
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.reshape(e * rank, -1))
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[2], -1))
    return tensors


def expert_config(model: nnx.Module, rank: int, alpha: float) -> dict[str, Any]:
    """adapter_config.json's entries for the expert adapters: target_parameters and the fused parameters' rank and
    alpha patterns (empty without expert adapters)."""
    groups = expert_groups(model)
    # PEFT (0.21) looks a wrapped parameter's rank up by "module.parameter", as here, but its check that every pattern
    # matched something looks at targeted modules only, so loading warns that these keys "were ignored": they were
    # not (tests/test_lora_export.py compares peft's logits).
    wide = {re.escape(key): len(parts) for key, _, _, parts in groups if len(parts) > 1}
    return {"target_parameters": [key for key, _, _, _ in groups],
            "rank_pattern": {k: n * rank for k, n in wide.items()},
            "alpha_pattern": {k: n * alpha for k, n in wide.items()}}


def load_expert_tensors(model: nnx.Module, tensors: dict[str, np.ndarray], path: str) -> None:
    """Set the model's expert adapters from PEFT tensors (`expert_tensors`' layout), in place."""
    want = expert_tensors(model)
    for key, prefix, layer, parts in expert_groups(model):
        names = (f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight")
        if any(n not in tensors or tensors[n].shape != want[n].shape for n in names):
            raise KeyError(f"{path} has no adapter for {key} of this model's rank and parts; it was saved for other "
                           "targets or another rank.")
        _, rows = _rows(model.layers[layer].mlp, tuple(name for name, _ in _fused_parts(model, parts)),
                        _interleaved(model))
        e = parts[0][1].shape[0]
        a = tensors[names[0]].reshape(e, -1, tensors[names[0]].shape[1])  # [E, R, in]
        b = tensors[names[1]].reshape(tensors[names[1]].shape[0], -1, e).transpose(2, 1, 0)  # [E, R, out]
        r = a.shape[1] // len(parts)
        for p, (name, node) in enumerate(parts):
            node.lora_a.set_value(jnp.asarray(a[:, p * r:(p + 1) * r].transpose(0, 2, 1), node.lora_a.dtype))
            node.lora_b.set_value(jnp.asarray(b[:, p * r:(p + 1) * r][..., rows[name]], node.lora_b.dtype))
