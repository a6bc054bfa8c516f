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
the finished length, in the loop's thread, between dispatches: the samples a dispatch finishes share calls).
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


def _routes_fn(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, as_tree(params))
    segments = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(jnp.int32)  # a row per sequence
    _, extras = model.hidden(tokens, segment_ids=segments, record_routes=True)
    return extras["routes"]  # [R, T, L_moe, k]


def sequence_routes_many(engine: Any, params: Any, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """One [len(seq), L_moe, k] int32 array per sequence: the experts `engine`'s model (with `params`, placed on the
    engine's devices) sends each token to in each expert layer, in one forward over each whole sequence. Sequences
    of one padded length (`routes_length`) share calls of up to prefill_tokens tokens, rows padded to a power of
    two; one program per (rows, length), compiled on first use."""
    if not getattr(engine.config, "num_experts", 0):
        raise ValueError("sequence_routes needs a mixture-of-experts model: this one has no experts.")
    for seq in sequences:
        if not 1 <= len(seq) <= engine.max_len:
            raise ValueError(f"sequence_routes takes 1 to max_len={engine.max_len} tokens, got {len(seq)}.")
    fn = engine.__dict__.get("_jit_routes")
    if fn is None:  # one jitted function per engine, bound to its graphdef
        fn = engine.__dict__["_jit_routes"] = jax.jit(lambda p, t, n: _routes_fn(engine.graphdef, p, t, n))
    out: list[np.ndarray | None] = [None] * len(sequences)
    by_size: dict[int, list[int]] = {}
    for i, seq in enumerate(sequences):
        by_size.setdefault(routes_length(engine, len(seq)), []).append(i)
    for size, members in sorted(by_size.items()):
        cap = 1 << (max(1, int(getattr(engine, "prefill_tokens", size)) // size).bit_length() - 1)
        for start in range(0, len(members), cap):
            chunk = members[start:start + cap]
            rows = 1 << (len(chunk) - 1).bit_length()
            tokens = np.zeros((rows, size), np.int32)
            lengths = np.ones(rows, np.int32)
            for r, i in enumerate(chunk):
                tokens[r, :len(sequences[i])] = np.asarray(sequences[i], np.int32)
                lengths[r] = len(sequences[i])
            got = np.asarray(jax.device_get(engine._call(fn, params, tokens, lengths)))
            for r, i in enumerate(chunk):
                out[i] = got[r, :len(sequences[i])].astype(np.int32)
    return out  # type: ignore[return-value]


def sequence_routes(engine: Any, params: Any, tokens: Sequence[int]) -> np.ndarray:
    """`sequence_routes_many` of one sequence."""
    return sequence_routes_many(engine, params, [tokens])[0]
