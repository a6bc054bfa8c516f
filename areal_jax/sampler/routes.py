"""The experts a mixture-of-experts model sent each token of a sample to, for the trainer's routing agreement metric
and rollout routing replay (`train.router_replay`).

With `SamplerLoop(record_routes=True)` each sample that finishes ("stop" or "length") gets `Completion.routes`
[P + N, L_moe, k] (uint8 up to 256 experts: `moe.routes_dtype`): every expert layer's top k of every prompt and generated token, as the sampler computed them.
The prompt's come from the prefill whose logits drew the first token (`Engine.prefill_many(routes=True)`); each
generated token's from the decode step that sampled it, which feeds it to the model in the same step
(`Engine.generate_steps(routes=True)`, fetched with the tokens). They are the routes of the behaviour policy, so a
replaying trainer sends each token through the sub-network that produced the logits it is scored against, up to the
difference between its weights and the sampler's (their version, `eta` behind at most, and their dtype:
`rollout.param_dtype`).

A sample interrupted by a weight update (`rollout.on_update=recompute`) keeps the routes recorded before: its tokens so
far were sampled under the old params, and the recompute's prefill only rebuilds the KV cache. A sample whose prompt is
prefilled again before it generated anything (staged at an update, or preempted and resumed: `sampler.preempt`) takes
the new prefill's routes, since its first token will be drawn from those logits.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from areal_jax.models.moe import moe_layer_count
from areal_jax.sampler.state import Prefix


def token_routes(cfg: Any) -> jax.ShapeDtypeStruct:
    """What a token's recorded experts are: [L_moe, k] in `moe.routes_dtype` (the sampler's programs cast to it)."""
    return jax.ShapeDtypeStruct((moe_layer_count(cfg), cfg.num_experts_per_tok), routes_dtype(cfg.num_experts or 1))


def split_routes(prefix: Prefix) -> tuple[Prefix, Any]:
    """(``prefix`` without its routes, the routes [P, L_moe, k] or None): the loop keeps a prompt's routes on the
    host side, so the inserts that copy the prefix into slots take the same arguments whether routes are recorded."""
    return dataclasses.replace(prefix, routes=None), prefix.routes


def sample_routes(prompt_routes: Any, prompt_len: int, decoded: list[np.ndarray]) -> np.ndarray:
    """[prompt_len + N, L_moe, k]: the prompt's routes (a device or host array of at least prompt_len rows, fetched
    here) then the N decoded tokens' (``decoded``: [n_i, L_moe, k] chunks, one per dispatch), in their dtype."""
    return np.concatenate([np.asarray(prompt_routes)[:prompt_len], *decoded])


def routes_dtype(num_experts: int) -> np.dtype:
    """The smallest integer dtype that holds expert ids 0..num_experts - 1: what recorded routes are kept in on the
    host (uint8 up to 256 experts: a sampler's routes of an 8k-token sample at 48 expert layers, top 8, take 3 MiB
    rather than 12)."""
    for dtype in (np.uint8, np.int16):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int32)
