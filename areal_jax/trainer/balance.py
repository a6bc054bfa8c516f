"""Auxiliary-loss-free load balancing of a mixture of experts (DeepSeek-V3's, `train.router_bias_rate`).

DeepSeek-V3's router adds a per-expert bias to its scores when it picks the top k (never to the weights:
`routing.route`). No gradient reaches that bias. Instead, after each optimizer step, each expert's bias moves by a
fixed rate toward balance: up for an expert picked less often than its layer's mean over that step's tokens, down
for one picked more often, unchanged at the mean (b_e += rate * sign(mean - picks_e)). Off by default (rate 0): a
reinforcement-learning update of a trained model keeps the bias as loaded.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

BIAS = "router_score_bias"


def bias_layers(model_cfg: Any) -> tuple[int, ...]:
    """The indices of the layers with a picking bias, in the order of the router counts' rows (the model's expert
    layers); none when the model has no such bias."""
    if model_cfg is None or not getattr(model_cfg, "router_score_bias", False):
        return ()
    return tuple(i for i in range(model_cfg.num_layers) if model_cfg.layer_is_moe(i))


def _layer_of(path: tuple) -> int | None:
    """The layer index of a params path layers/<i>/mlp/router_score_bias/..., else None."""
    keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
    if len(keys) >= 4 and keys[0] == "layers" and keys[2] == "mlp" and keys[3] == BIAS:
        return int(keys[1])
    return None


def found_layers(params: Any) -> tuple[int, ...]:
    """The layers whose picking bias is among `params` (a state, shardings or shapes shaped like the params)."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    return tuple(sorted(i for i in (_layer_of(p) for p, _ in paths) if i is not None))


def nudge_bias(params: Any, counts: jax.Array, rate: float, layers: tuple[int, ...]) -> Any:
    """params with each listed layer's picking bias moved by rate * sign(mean - picks) per expert. counts [L_moe, E]:
    the top-k picks of each expert layer's experts over the step's real tokens (row j: layers[j])."""
    row = {layer: j for j, layer in enumerate(layers)}

    def nudge(path, leaf):
        layer = _layer_of(path)
        if layer is None or layer not in row:
            return leaf
        picks = counts[row[layer]].astype(jnp.float32)
        step = jnp.float32(rate) * jnp.sign(jnp.mean(picks) - picks)
        return (leaf.astype(jnp.float32) + step).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(nudge, params)
