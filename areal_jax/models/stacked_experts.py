"""Checkpoints that stack a layer's experts in two tensors (Qwen3-VL-MoE's text decoder): read as Qwen3-MoE's
per-expert tensors.

Qwen3-MoE's files hold `mlp.experts.{j}.gate_proj.weight` [F, D], `up_proj` [F, D] and `down_proj` [D, F] for each
expert j. Qwen3-VL-MoE's hold `mlp.experts.gate_up_proj` [E, D, 2F] (each expert's gate in its first F columns, its
up projection in the last F) and `mlp.experts.down_proj` [E, F, D]. The checkpoint reader answers the per-expert
names from the stacked tensors (`source`, `shape`, `take`), so the model's weight names stay Qwen3-MoE's and saving
writes those; `stack` builds a stacked tensor again from them (models.wrapped_export).
"""
from __future__ import annotations

import re
from typing import Container

import numpy as np

_PER_EXPERT = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight$")


def source(name: str, names: Container[str]) -> tuple[str, int, str] | None:
    """(the stacked tensor's name, the expert, "gate" | "up" | "down") that holds the per-expert tensor `name` in a
    checkpoint whose tensor names are `names`; None where `name` is there itself or no stacked tensor holds it."""
    m = _PER_EXPERT.match(name)
    if m is None or name in names:
        return None
    stacked = f"{m['base']}.{'down_proj' if m['part'] == 'down' else 'gate_up_proj'}"
    return (stacked, int(m["expert"]), m["part"]) if stacked in names else None


def shape(part: str, stacked_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The per-expert tensor's shape: [F, D] for gate and up (of gate_up_proj [E, D, 2F]), [D, F] for down (of
    down_proj [E, F, D])."""
    if len(stacked_shape) != 3:
        raise ValueError(f"A stacked expert tensor has three axes [experts, in, out]; this one has {stacked_shape}.")
    _, rows, cols = stacked_shape
    return (cols, rows) if part == "down" else (cols // 2, rows)


def take(part: str, expert: np.ndarray) -> np.ndarray:
    """The per-expert tensor from one expert's slice of the stacked one ([D, 2F] of gate_up_proj, [F, D] of
    down_proj)."""
    if part == "down":
        return np.ascontiguousarray(expert.T)
    half = expert.shape[1] // 2
    return np.ascontiguousarray((expert[:, :half] if part == "gate" else expert[:, half:]).T)


def stack(parts: dict[tuple[int, str], np.ndarray]) -> np.ndarray:
    """The stacked tensor from every expert's per-expert tensors, {(expert, part): tensor}: gate_up_proj
    [E, D, 2F] from the gate and up ones ([F, D] each), or down_proj [E, F, D] from the down ones ([D, F])."""
    experts = sorted({j for j, _ in parts})
    if experts != list(range(len(experts))):
        raise ValueError(f"The per-expert tensors cover experts {experts}, not 0..{len(experts) - 1}.")
    if all(part == "down" for _, part in parts):
        out = np.stack([parts[(j, "down")].T for j in experts])
    else:
        out = np.stack([np.concatenate([parts[(j, "gate")].T, parts[(j, "up")].T], axis=1) for j in experts])
    return np.ascontiguousarray(out)  # np.stack keeps the transposes' strides; safetensors writes the raw buffer
