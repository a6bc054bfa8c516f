"""Checks of the `ModelConfig` fields of the newer stateful mixers' shapes (Jamba's and Mamba's `Mamba1`, Falcon-H1's
`HybridScales`), and `_named`, which turns any such field given as a tuple or dict into its NamedTuple (re-exported by
`config_checks`)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


def _named(kind: type, value, field: str):
    """A NamedTuple `kind` of a ModelConfig field given as one, a tuple or a dict; a clear error otherwise."""
    try:
        return kind(**value) if isinstance(value, dict) else kind(*value)
    except TypeError as err:
        raise ValueError(f"ModelConfig.{field} must be {kind.__name__}({', '.join(kind._fields)}); got "
                         f"{value!r}.") from err


class Mamba1(NamedTuple):
    """A Mamba mixer's shapes (Jamba's, Mamba's "linear_attention" layers: `models.mamba1`): `inner` channels of
    `state` states each, a time step of rank `dt_rank`, a convolution of `conv_kernel` taps; `norms`: its time step's
    input, B and C RMS-normalised with scales ("scaled": Jamba's), without ("plain": Falcon-Mamba's), or not at all
    (None: Mamba's), with epsilon `norm_eps` (None: the model's rms_norm_eps)."""
    inner: int
    state: int
    dt_rank: int
    conv_kernel: int = 4
    norms: str | None = "scaled"
    norm_eps: float | None = None


def _check_mamba1(cfg) -> None:
    """`ModelConfig.mamba1` made a `Mamba1` and checked: its "linear_attention" layers are Mamba's, at least one."""
    if cfg.mamba1 is None:
        return
    m = _named(Mamba1, cfg.mamba1, "mamba1")
    if any(not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1 for x in m[:4]) or m.conv_kernel < 2 \
            or m.norms not in ("scaled", "plain", None) or m.norm_eps is not None and not float(m.norm_eps) > 0:
        raise ValueError(f"ModelConfig.mamba1 needs positive integers, conv_kernel >= 2, norms one of 'scaled', "
                         f"'plain', None and norm_eps positive or None; got {m}.")
    if cfg.linear is not None or cfg.short_conv is not None or cfg.mamba is not None or \
            "linear_attention" not in (cfg.layer_types or ()) or "hybrid" in (cfg.layer_types or ()):
        raise ValueError("ModelConfig.mamba1 makes the linear_attention layers Mamba's: it needs some, no hybrid "
                         "layers, and linear, short_conv and mamba None.")
    object.__setattr__(cfg, "mamba1", m if m.norm_eps is None else m._replace(norm_eps=float(m.norm_eps)))


class HybridScales(NamedTuple):
    """Falcon-H1's multipliers of its "hybrid" layers (attention and Mamba-2 side by side): the attention's input
    (attention_in) and output (attention_out), its keys (key), the mixer's input (ssm_in) and output (ssm_out),
    in_proj's parts z, x, B, C, dt (ssm_parts), the MLP's gate before its activation (mlp_gate) and its output
    (mlp_down), and the logits (lm_head)."""
    attention_in: float = 1.0
    attention_out: float = 1.0
    key: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm_parts: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_gate: float = 1.0
    mlp_down: float = 1.0
    lm_head: float = 1.0


def _check_hybrid(cfg) -> None:
    """"hybrid" layers need Mamba-2 shapes (their mixer's); `hybrid_scales` made a `HybridScales` of finite floats."""
    if "hybrid" in (cfg.layer_types or ()) and cfg.mamba is None:
        raise ValueError("ModelConfig.layer_types has hybrid layers (attention and a Mamba-2 mixer side by side) but "
                         "mamba is None; set mamba=Mamba2(heads, head_dim, state, groups, conv_kernel).")
    if cfg.hybrid_scales is None:
        return
    s = _named(HybridScales, cfg.hybrid_scales, "hybrid_scales")
    s = s._replace(ssm_parts=tuple(float(x) for x in s.ssm_parts))
    values = [v for f, v in zip(s._fields, s) if f != "ssm_parts"] + list(s.ssm_parts)
    if len(s.ssm_parts) != 5 or not all(np.isfinite(float(v)) for v in values):
        raise ValueError(f"ModelConfig.hybrid_scales needs finite numbers, five of them in ssm_parts; got {s}.")
    object.__setattr__(cfg, "hybrid_scales", HybridScales(*(float(v) if f != "ssm_parts" else v
                                                            for f, v in zip(s._fields, s))))
