"""The stateful token mixer of a model's linear layers (`ModelConfig.layer_is_linear`): Gated DeltaNet (Qwen3.5,
Qwen3-Next, OLMo Hybrid: `models.gated_deltanet`), the gated short convolution (LFM2: `models.short_conv`), Mamba-2
(Granite 4.0-H, Bamba, Nemotron-H; Falcon-H1's beside attention in its hybrid layers: `models.mamba2`) or Mamba
(Jamba: `models.mamba1`). Each kind's module gives the same names, which the decoder, the sampler's cache, the memory
plans, the parameter counts and LoRA read through `kind`:

- `Mixer`: the nnx module of one layer, `Mixer(cfg, rngs=...)(x, context)`;
- `state_buffers(cfg, rows)`: a layer's zero cache entries for `rows` rows (its window, its state), and
  `state_bytes(cfg)`: one row's bytes of them;
- `weights(cfg)`: (the matrices a token multiplies through, the other parameters) of one layer;
- `adapter_dims(cfg)`: {LoRA short name: (inputs, outputs)} of its projections, in the order `lora.targets` lists them.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any


def kind(cfg: Any) -> ModuleType:
    """The module of `cfg`'s stateful mixer (whichever of ModelConfig.short_conv / .mamba1 / .mamba / .linear it
    sets)."""
    from areal_jax.models import gated_deltanet, mamba1, mamba2, short_conv  # noqa: PLC0415 (they build on layers)

    if cfg.short_conv is not None:
        return short_conv
    if cfg.mamba1 is not None:
        return mamba1
    return mamba2 if cfg.mamba is not None else gated_deltanet
