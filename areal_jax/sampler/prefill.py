"""Prefill as pure functions: prompt rows through the model once, their caches as Prefixes or written
into decode slots. The Engine jits them; the paged engine reuses prefill_rows."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import KVCache, init_cache
from areal_jax.sampler.state import Prefix

# Padded tokens per batched prefill call at most (`Engine.prefill_rows_for`): 8 rows up to 2,048-token buckets,
# one row of a 16,384-token recompute (whose activations and rows' cache would otherwise be 8x larger).
PREFILL_TOKENS = 16384


def prefill_rows(model: nnx.Module, config, tokens: jax.Array, lengths: jax.Array, routes: bool = False) -> tuple:
    """tokens [R, P] int32 (tail padded), lengths [R] -> (cache of L layers [R, P, ...], logits [R, V] f32), and with
    routes a mixture-of-experts model's experts of each position, [R, P, L_moe, k] int32, third."""
    r, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], (r, p))
    positions = held_positions(config, positions, positions < lengths[:, None])
    h, cache, *picks = model.hidden(tokens, positions, cache=init_cache(config, r, p), record_routes=routes,
                                    fresh=True)
    last = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)  # [R, 1, D]
    return cache, model.unembed(last)[:, 0].astype(jnp.float32), *picks


def held_positions(config, positions: jax.Array, real: jax.Array) -> jax.Array:
    """positions with -1 where ``real`` is False (a prefill's padding, a finished row's decode step), for a model with
    Gated DeltaNet layers, whose states such a token must not advance; other models' positions as they are (their
    writes there are overwritten or never read, and their programs lower as before)."""
    return jnp.where(real, positions, -1) if config.recurrent else positions


def last_tokens(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """[R] the last real token of each tail-padded row of tokens [R, P]."""
    return jnp.take_along_axis(tokens, jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]


def row_prefixes(cache: KVCache, logits: jax.Array, tokens: jax.Array, lengths: jax.Array,
                 routes: jax.Array | None = None) -> tuple[Prefix, ...]:
    """prefill_rows' output as R one-row Prefixes (each its own buffers; routes [R, P, L_moe, k] too, if given)."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    last = last_tokens(tokens, lengths)
    return tuple(
        Prefix(cache=jax.tree.map(lambda x, r=r: x[r : r + 1], cache), logits=logits[r], logprobs=logprobs[r],
               true_length=lengths[r].astype(jnp.int32), last_token=last[r],
               routes=None if routes is None else routes[r])
        for r in range(tokens.shape[0]))


def ring_rows(src: jax.Array, lengths: jax.Array, ring: int) -> jax.Array:
    """Rows [R, P, ...] holding positions 0..P-1 (real below lengths [R]) laid out as rings of ``ring`` < P
    positions (`Transformer.hidden(ring=True)`): index j gets the row's last real position congruent to j mod
    ring. Indices no real position reaches get a copy of position 0; attention never reads them before the
    decode writes them."""
    last = lengths.reshape(-1, 1).astype(jnp.int32) - 1  # [R, 1]
    held = last - jnp.remainder(last - jnp.arange(ring, dtype=jnp.int32)[None, :], ring)  # [R, ring]
    index = jnp.clip(held, 0, src.shape[1] - 1).reshape(held.shape + (1,) * (src.ndim - 2))
    return jnp.take_along_axis(src, jnp.broadcast_to(index, held.shape + src.shape[2:]), axis=1)


def write_rows(cache: KVCache, rows: KVCache, slots: jax.Array, lengths: jax.Array) -> KVCache:
    """Write each layer's rows [R, P, ...] into positions 0..P-1 of `slots` [n] of the decode cache; one row
    (R = 1) is copied to every slot. Slots out of range are dropped (padding of a batched call). lengths [R]
    (or []): each row's real positions, which a ring layer shorter than P keeps the last of (`ring_rows`)."""
    n = slots.shape[0]

    def write(dst: jax.Array, src: jax.Array) -> jax.Array:
        if dst.shape[1] == 0:  # a layer held elsewhere (in pages, beside rings: paged_attention.init_rings)
            return dst
        if src.shape[1] > dst.shape[1]:  # a ring: a sliding layer's buffer is shorter than any prompt bucket
            src = ring_rows(src, jnp.broadcast_to(lengths, src.shape[:1]), dst.shape[1])
        p = src.shape[1]
        return dst.at[slots, :p].set(jnp.broadcast_to(src.astype(dst.dtype), (n,) + src.shape[1:]), mode="drop")

    return jax.tree.map(write, cache, rows)


def trim_prefix(prefix: Prefix, length: int) -> Prefix:
    """``prefix`` with its cache cut to the first ``length`` positions (static)."""
    return dataclasses.replace(prefix, cache=jax.tree.map(lambda x: x[:, :length], prefix.cache))


def prefill_many(engine: Any, params: Any, prompts: Sequence[Sequence[int]], routes: bool = False) -> list[Prefix]:
    """``Engine.prefill_many``: batched calls of ``call_rows`` prompts, one Prefix per prompt, in order. A prompt
    shorter than its call's bucket gets its cache cut back to its own bucket (a small copy), so that a Prefix
    holds P = its prompt's bucket positions whatever it was batched with: a short prompt then still fits a
    standby row (``standby_len``), and an insert copies only its own bucket. routes: each Prefix carries the
    prefill's experts (``Prefix.routes``, at the call's padded length)."""
    lengths = [len(p) for p in prompts]
    if any(n < 1 for n in lengths):
        raise ValueError(f"prefill_many got an empty prompt (lengths {lengths}).")
    out: list[Prefix] = []
    start = 0
    while start < len(prompts):
        chunk = prompts[start : start + call_rows(engine, lengths[start:])]
        start += len(chunk)
        bucket = engine.bucket_for(max(len(p) for p in chunk))
        full = (engine.prefill_rows_for(bucket), bucket)
        shapes = engine._prefill_many_shapes
        rows = 1 if len(chunk) == 1 and (full not in shapes or (1, bucket) in shapes) else full[0]
        shapes.add((rows, bucket))
        tokens = np.zeros((rows, bucket), np.int32)
        n = np.ones((rows,), np.int32)
        for r, prompt in enumerate(chunk):
            tokens[r, : len(prompt)] = np.asarray(prompt, np.int32)
            n[r] = len(prompt)
        if (rows, routes) not in engine._jit_prefill_many:  # setdefault: loops sharing the engine get one program
            sharding = engine._prefix_sharding
            if sharding is not None and routes:
                sharding = dataclasses.replace(sharding, routes=sharding.logits)  # replicated, as the logits
            fn = functools.partial(engine._prefill_many_fn, routes=routes)
            engine._jit_prefill_many.setdefault((rows, routes), jax.jit(
                fn, out_shardings=None if sharding is None else (sharding,) * rows))
        for prompt, prefix in zip(chunk, engine._call(engine._jit_prefill_many[rows, routes], params, tokens, n)):
            own = engine.bucket_for(len(prompt))
            if own != bucket:  # the routes stay as they are (read on the host up to the true length)
                prefix = dataclasses.replace(engine._call(engine._jit_trim, dataclasses.replace(prefix, routes=None),
                                                          own), routes=prefix.routes)
            out.append(prefix)
    return out


def call_rows(engine: Any, lengths: Sequence[int]) -> int:
    """How many of the leading ``lengths`` one batched prefill call takes: the most (up to prefill_batch, at least
    one) that the bucket of the longest of them allows (``Engine.prefill_rows_for``)."""
    n = longest = 0
    for length in lengths[: engine.prefill_batch]:
        longest = max(longest, int(length))
        if n + 1 > engine.prefill_rows_for(engine.bucket_for(longest)):
            break
        n += 1
    return max(1, n)


def insert_sequences(engine: Any, params: Any, decode_state: Any, slots: Sequence[int],
                     sequences: Sequence[Sequence[int]], samplings: Sequence[Any]) -> Any:
    """``Engine.insert_sequences``: prefill ``sequences[i]`` and arm ``slots[i]`` with it and ``samplings[i]``.

    Sequences are sorted by length and prefilled ``engine.prefill_rows_for(bucket)`` rows per call (each call padded to
    the bucket of its longest row; one compiled program per bucket), fused with the insertion."""
    if not (len(slots) == len(sequences) == len(samplings)):
        raise ValueError("insert_sequences needs one slot and one SamplingParams per sequence.")
    if len(set(int(s) for s in slots)) != len(slots):
        raise ValueError(f"insert_sequences needs distinct slots, got {list(slots)}.")
    for s, seq in zip(slots, sequences):
        engine._check_slot(s)
        if len(seq) < 1:
            raise ValueError(f"insert_sequences got an empty sequence for slot {s}.")
    order = sorted(range(len(slots)), key=lambda i: len(sequences[i]))
    start = 0
    while start < len(order):
        chunk = order[start : start + call_rows(engine, [len(sequences[i]) for i in order[start:]])]
        start += len(chunk)
        width = engine.bucket_for(max(len(sequences[i]) for i in chunk))
        rows = engine.prefill_rows_for(width)  # the bucket's one program: padding rows' writes are dropped
        tokens = np.zeros((rows, width), np.int32)
        lengths = np.ones((rows,), np.int32)
        slot_ids = np.full((rows,), engine.num_slots, np.int32)  # padding rows: writes dropped
        per_row = [engine.settings(samplings[chunk[0]])] * rows
        for r, i in enumerate(chunk):
            tokens[r, : len(sequences[i])] = sequences[i]
            lengths[r], slot_ids[r] = len(sequences[i]), int(slots[i])
            per_row[r] = engine.settings(samplings[i])
        settings = jax.tree.map(lambda *xs: np.stack(xs), *per_row)
        decode_state = engine._call(engine._jit_prefill_insert, params, decode_state, tokens, lengths, slot_ids,
                                    settings)
    return decode_state

