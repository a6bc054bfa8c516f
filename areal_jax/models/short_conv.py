"""The gated short convolution of LFM2 (`Lfm2ForCausalLM`, `Lfm2MoeForCausalLM`): the token mixer of its "conv"
layers, between its layers of attention.

    B, C, x = in_proj(h);   y = out_proj(C * conv(B * x))

with conv a causal depthwise convolution of `ModelConfig.short_conv` taps (LFM2's conv_L_cache) over the hidden
channels, no activation and no bias. A layer keeps no state but the convolution's window: in a KV-cache forward its
cache entries are that window, k [B, taps - 1, hidden, 1] float32 (the last inputs B * x, oldest first), and an empty
v [B, 0, hidden, 1] (`state_buffers`; its hidden axis splits over a tensor axis as the window's does); a token at a negative position (padding) leaves the window as it is, so a
tail-padded prefill ends with each row's own. Packed rows' segments are kept apart: a tap never reads another
segment's tokens (`gated_deltanet.segment_conv`).

in_proj holds its three parts channel by channel ([D, hidden, 3]: B, C and x of channel c side by side, flattened to
[D, 3 * hidden]), so that a tensor axis splits every part of the layer by channels alike; transformers keeps all of
B, then all of C, then all of x (`interleaved_channels`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.gated_deltanet import Segments, StateCache, segment_conv, window_conv
from areal_jax.models.layers import make_param, project


def interleaved_channels(width: int) -> np.ndarray:
    """Where our in_proj columns come from in HF's rows: ours[3 c + j] = HF's[j * width + c] (j: B, C, x)."""
    return (np.arange(3)[None, :] * width + np.arange(width)[:, None]).reshape(-1)


def state_buffers(cfg: ModelConfig, rows: int) -> tuple[jax.Array, jax.Array]:
    """A conv layer's zero cache entries for `rows` rows: (window [rows, taps - 1, hidden, 1] float32, an empty
    [rows, 0, hidden, 1]: the layer has no state besides its window)."""
    return (jnp.zeros((rows, cfg.short_conv - 1, cfg.hidden_size, 1), jnp.float32),
            jnp.zeros((rows, 0, cfg.hidden_size, 1), jnp.float32))


def state_bytes(cfg: ModelConfig) -> int:
    """Bytes of one row's `state_buffers` in one conv layer."""
    return 4 * (cfg.short_conv - 1) * cfg.hidden_size


def weights(cfg: ModelConfig) -> tuple[int, int]:
    """(matrices, the rest) of one conv layer: in_proj and out_proj; the taps."""
    return 4 * cfg.hidden_size ** 2, cfg.short_conv * cfg.hidden_size


def adapter_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{LoRA short name: (inputs, outputs)} of a conv layer's projections."""
    return {"in": (cfg.hidden_size, 3 * cfg.hidden_size), "out": (cfg.hidden_size, cfg.hidden_size)}


class ShortConv(nnx.Module):
    """LFM2's gated short convolution: in_proj [D, 3 * D] (B, C, x channel by channel: `interleaved_channels`),
    conv [taps, D] and out_proj [D, D]; on a tensor axis all split by channels ("mlp")."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, pdt = cfg.hidden_size, cfg.param_dtype
        self.dtype = cfg.dtype
        self.in_proj = make_param(rngs, (d, 3 * d), ("embed", "mlp"), pdt)
        self.conv = make_param(rngs, (cfg.short_conv, d), (None, "mlp"), pdt, std=0.5)
        self.out_proj = make_param(rngs, (d, d), ("mlp", "embed"), pdt)

    def __call__(self, x: jax.Array, context: Segments | StateCache) -> jax.Array:
        """x [B, T, D] (the layer's normed input) -> [B, T, D] in the compute dtype."""
        dt = self.dtype
        b, t, d = x.shape
        parts = project(x, self.in_proj, dt).reshape(b, t, d, 3)  # (each a parameter, or LoRA's base plus adapters)
        gate_b, gate_c, value = parts[..., 0], parts[..., 1], parts[..., 2]
        mixed = gate_b * value
        w = self.conv[...].astype(dt)
        if isinstance(context, Segments):
            conv = segment_conv(mixed, w, context.segment_ids)
        else:
            conv, window = window_conv(mixed, w, context.window[..., 0], context.valid)
            context.store(window[..., None].astype(context.window.dtype), context.state)
        return project(gate_c * conv.astype(dt), self.out_proj, dt)


Mixer = ShortConv
