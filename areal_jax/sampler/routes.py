"""The experts a mixture-of-experts model sends each token of a finished sample to, for the trainer's routing
agreement metric and rollout routing replay (`train.router_replay`).

With `SamplerLoop(record_routes=True)` each sample that finishes ("stop" or "length") gets `Completion.routes`
[P + N, L_moe, k]: one forward of the sampler's model over its prompt and generated tokens, with the params the loop
holds then, in the sampler's dtype, recording every expert layer's top k of every token (`Transformer.hidden(
record_routes=True)`). The trainer then compares its own routing with them, or sends each token to them.

What they capture is what separates the sampler's routing from the trainer's: the sampler's weights (their version,
`eta` behind at most, and their dtype: `rollout.param_dtype`). They are not the decode's own top k token by token: the
decode reads a KV cache (the same values, summed in another order) and, for a sample interrupted by a weight update
(`rollout.on_update=recompute`), decoded its first tokens under older params, where this forward uses the params
it finished with. The cost is one forward per finished sample over its prompt and completion (a prefill's work at
the finished length, in the loop's thread, between dispatches).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import as_tree


def routes_length(engine: Any, n: int) -> int:
    """The padded length a sequence of n tokens is routed at: the engine's smallest prefill bucket holding it, else
    its max_len (a sample grows past the largest bucket only with on_update="continue")."""
    return next((int(b) for b in engine.prefill_buckets if b >= n), int(engine.max_len))


def _routes_fn(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array, length: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, as_tree(params))
    segments = (jnp.arange(tokens.shape[1])[None, :] < length).astype(jnp.int32)
    _, extras = model.hidden(tokens, segment_ids=segments, record_routes=True)
    return extras["routes"][0]  # [T, L_moe, k]


def sequence_routes(engine: Any, params: Any, tokens: Sequence[int]) -> np.ndarray:
    """[len(tokens), L_moe, k] int32: the experts `engine`'s model (with `params`, placed on the engine's devices)
    sends each token to in each expert layer, in one forward over the whole sequence. One program per padded
    length (`routes_length`), compiled on first use."""
    if not getattr(engine.config, "num_experts", 0):
        raise ValueError("sequence_routes needs a mixture-of-experts model: this one has no experts.")
    n = len(tokens)
    if not 1 <= n <= engine.max_len:
        raise ValueError(f"sequence_routes takes 1 to max_len={engine.max_len} tokens, got {n}.")
    size = routes_length(engine, n)
    padded = np.zeros((1, size), np.int32)
    padded[0, :n] = np.asarray(tokens, np.int32)
    fn = engine.__dict__.get("_jit_routes")
    if fn is None:  # one jitted function per engine, bound to its graphdef
        fn = engine.__dict__["_jit_routes"] = jax.jit(lambda p, t, n: _routes_fn(engine.graphdef, p, t, n))
    out = engine._call(fn, params, padded, np.int32(n))
    return np.asarray(jax.device_get(out))[:n].astype(np.int32)
