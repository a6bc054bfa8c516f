"""Attention of new queries over a KV cache (decode and prefill), read chunk by chunk with an online softmax.

`cached_attention` is the dense cache's path; the paged cache's paths (`paged_attention`) keep its semantics.
How many positions a step reads (`cache_chunk_size`), how many queries are scored at once (`query_block_size`)
and whether a decode call's chunk loop has a trip count XLA knows (`counted_decode_loop`) are chosen here, and
whether a decode call reads each row only up to its own length through `ragged_decode`'s kernel instead
(`ragged_decode_calls`, the sampler's ``Engine(decode_attention="kernel")``).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.attention_sinks import sink_start
from areal_jax.models.layers import MASK_VALUE, _group_queries, soft_cap
from areal_jax.models.ragged_decode import decode_attention, supports

# Cache positions per step of `cached_attention`. XLA:CPU copies a chunk out of the layer's cache before its
# matrix products; at 128 positions that copy stays in the core's L2 cache (decode at 1024 positions took 67 ms
# against 92 ms in one pass, benchmarks/decode_attention.py). On an H200 one pass over up to 8192 was fastest.
CPU_CACHE_CHUNK = 128
ACCELERATOR_CACHE_CHUNK = 8192
# float32 scores one `cached_attention` call holds at once (512 MiB); a longer prefill is scored in query blocks.
SCORE_ELEMENTS = 2**27


def cache_chunk_size(max_len: int, backend: str | None = None) -> int:
    """Cache positions `cached_attention` reads per loop step. On CPU: the cache split into
    ceil(max_len / CPU_CACHE_CHUNK) equal chunks (rounded up to a multiple of 8), so no chunk reads
    positions past the cache's end only to mask them: at max_len 176 that is 88, and a 64-slot decode
    step of the benchmark model took 12.3 ms against 15.4 ms with 128-position chunks (the whole
    benchmarks/sampler.py loop: 1,253-1,260 against 1,189-1,196 tokens/s, two runs each). Elsewhere
    min(max_len, ACCELERATOR_CACHE_CHUNK). backend defaults to jax.default_backend()."""
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu":
        return min(max_len, ACCELERATOR_CACHE_CHUNK)
    n = -(-max_len // CPU_CACHE_CHUNK)
    even = -(-max_len // max(n, 1))
    return max(1, min(max_len, -(-even // 8) * 8))


_COUNTED_DECODE = contextvars.ContextVar("counted_decode_loops", default=None)


@contextlib.contextmanager
def counted_decode_loops(counted: bool | None) -> Iterator[None]:
    """Within it (while a program is traced), `cached_attention`'s decode calls loop over the whole cache
    (True), stop after the batch's largest position (False), or follow the backend (None): how the sampler's
    ``Engine(counted_loop=...)`` makes its dispatch's loops agree."""
    token = _COUNTED_DECODE.set(counted)
    try:
        yield
    finally:
        _COUNTED_DECODE.reset(token)


def counted_decode_loop(backend: str | None = None) -> bool:
    """Whether a single-token (decode) `cached_attention` call reads every chunk of the cache in a loop whose
    trip count XLA knows, rather than stopping after the chunk of the batch's largest position. On GPUs XLA
    runs a loop whose trip count depends on data by reading its condition on the host before every trip, so
    with a cache longer than one chunk (over 8,192 positions) each layer of each decode step would wait for
    the device; there the whole cache is read instead (as it is in one pass up to 8,192 positions), which
    costs little with many rows, since one of them mostly sits near the end. Elsewhere the loop stops early
    (the CPU evaluates the condition on the host anyway, a TPU on the device). `counted_decode_loops` overrides
    it; prefill calls (many queries per row) keep the early stop, each trip there being long."""
    counted = _COUNTED_DECODE.get()
    if counted is not None:
        return counted
    return (jax.default_backend() if backend is None else backend) == "gpu"


_RAGGED = contextvars.ContextVar("ragged_decode_calls", default=None)


@contextlib.contextmanager
def ragged_decode_calls(on: bool, mesh: jax.sharding.Mesh | None = None, interpret: bool | None = None,
                        tiling: tuple[int, int] | None = None) -> Iterator[None]:
    """Within it with ``on`` (while a program is traced), `cached_attention`'s decode calls over a whole cache
    (one query per row, no window, head widths the kernel takes: `ragged_decode.supports`) go through
    `ragged_decode.decode_attention`, which reads each row only up to its own position; mesh: the sampler's (the
    kernel then runs on each device's heads); interpret: run the kernel in the Pallas interpreter (default: off
    GPUs); tiling: the kernel's (splits, block) (default `ragged_decode.tiling`)."""
    token = _RAGGED.set((mesh, interpret, tiling) if on else None)
    try:
        yield
    finally:
        _RAGGED.reset(token)


def use_block_diagonal_queries(num_queries: int, kv_heads: int) -> bool:
    """Whether `cached_attention` contracts each chunk with block-diagonal queries (one matrix product per row,
    `_chunk_attention_block_diagonal`) rather than per (row, kv head): for single-token decode, where that was
    faster on CPU and on an H200 (the per-head form was 3x slower there), and for a single kv head, where it
    wastes nothing. Multi-token calls (prefill) keep the per-head form, which does K times fewer multiply-adds."""
    return num_queries == 1 or kv_heads == 1


def _chunk_attention_grouped(qg: jax.Array, k: jax.Array, v: jax.Array,
                             scale: np.float32) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """qg: [B, T, K, G, Dh]; k, v: [B, C, K, Dh] -> (scores [B, K, G, T, C] float32, probs -> [B, K, G, T, Dh] f32).

    Batched over (row, kv head): the backend lays each chunk out kv-head-major, which is cheap for a chunk and
    amortised over T queries."""
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale

    def weigh_values(probs: jax.Array) -> jax.Array:
        return jnp.einsum("bkgts,bskd->bkgtd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)

    return scores, weigh_values


def _chunk_attention_block_diagonal(qbd: jax.Array, k: jax.Array, v: jax.Array, shape: tuple[int, ...],
                                    scale: np.float32) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """qbd: [B, K*Dh, K*G*T] block-diagonal queries (zero unless the key head matches); k, v: [B, C, K, Dh] ->
    (scores [B, K, G, T, C] float32, probs -> [B, K, G, T, Dh] float32); shape = (B, K, G, T, Dh).

    Batched over rows only: each chunk is used as the contiguous [C, K*Dh] matrix it already is (no copy into a
    kv-head-major layout), at the price of K times the multiply-adds of the grouped form; both products
    stay far below the cost of reading the chunk when T is 1."""
    b, kv, group, t, dh = shape
    chunk = k.shape[1]
    scores = jnp.einsum("bsc,bcn->bns", k.reshape(b, chunk, kv * dh), qbd, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv, group, t, chunk) * scale
    same_head = np.eye(kv, dtype=bool)[None, :, None, None, :, None]

    def weigh_values(probs: jax.Array) -> jax.Array:
        every = jnp.einsum("bkgts,bsc->bkgtc", probs.astype(v.dtype), v.reshape(b, chunk, kv * dh),
                           preferred_element_type=jnp.float32).reshape(b, kv, group, t, kv, dh)
        return jnp.sum(jnp.where(same_head, every, 0.0), axis=4)

    return scores, weigh_values


def query_block_size(rows: int, queries: int, heads: int, chunk: int, score_elements: int = SCORE_ELEMENTS) -> int:
    """Queries `cached_attention` scores at once: all `queries` when rows x heads x queries x chunk float32 scores
    stay within `score_elements`, else equal blocks of at most that many, as few as can be (rounded up to a
    multiple of 8 where that still fits)."""
    per_query = max(1, rows * heads * chunk)
    if queries * per_query <= score_elements:
        return queries
    most = max(1, score_elements // per_query)
    block = -(-queries // -(-queries // most))  # the fewest blocks, evened out
    up = -(-block // 8) * 8
    return up if up <= most else block


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                     chunk_size: int | None = None, score_elements: int = SCORE_ELEMENTS,
                     counted: bool | None = None, window: int | None = None,
                     softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention of new queries over one layer's KV cache, chunk by chunk.

    q: [B, T, H, Dh] (RoPE applied); k_cache, v_cache: [B, S, K, Dh] (one layer of a `KVCache`), already
    holding this call's keys and values; positions: [B, T] int32. Query (b, t) attends cache indices
    0..positions[b, t] of row b (all S indices when the position is >= S, none when it is < 0: such a query
    gets zeros); with a sliding `window`, only indices above positions[b, t] - window (a decode call then reads
    only each row's window: `window_decode_attention`); softcap: the scaled scores' `layers.soft_cap` (Gemma 2);
    sinks: [H] each query head's sink logit (`attention_sinks`: the online softmax starts from it), or None.
    Returns [B, T, H, Dh] in q's dtype.

    The layer is read `chunk_size` positions at a time (default `cache_chunk_size(S)`) with an online float32
    softmax: the layer is never transposed or repeated per kv head (and, in one chunk, never copied), and the
    loop stops after the chunk holding the largest position in the batch, so the cost follows the longest live
    context rather than S. The trip count depends on the data: this path is for forward evaluation (no
    reverse-mode gradients); training uses `dot_attention`. With ``counted`` (default: decode calls on GPUs,
    `counted_decode_loop`) the loop reads every chunk instead, a trip count XLA knows.

    A long prefill (many queries per row) is scored `query_block_size` queries at a time, so its float32
    scores stay within `score_elements` whatever the prompt length: 8 rows of 16,384 tokens over one
    8,192-position chunk (the accelerator default) at 12 heads would otherwise score 48 GiB at once. Each
    block's chunk loop stops at the block's own last position, so on a chunked cache the blocks also skip
    the keys they are causally masked from.
    """
    b, t, h, dh = q.shape
    if (k_cache.ndim != 4 or k_cache.shape[0] != b or positions.shape != (b, t)
            or v_cache.shape != k_cache.shape):
        raise ValueError(f"cached_attention got q {q.shape}, caches {k_cache.shape} / {v_cache.shape} and positions "
                         f"{positions.shape}; expected q [B, T, H, Dh], caches [B, S, K, Dh] and positions [B, T].")
    s = k_cache.shape[1]
    chunk = cache_chunk_size(s) if chunk_size is None else min(int(chunk_size), s)
    if chunk <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
    if window is not None and t == 1 and window_span(window) < s:
        return window_decode_attention(q, k_cache, v_cache, positions, window, softcap, sinks)
    ragged = _RAGGED.get()
    if (ragged is not None and t == 1 and window is None and h % k_cache.shape[2] == 0
            and supports(dh, v_cache.shape[3], s)):
        return decode_attention(q, k_cache, v_cache, positions, softcap=softcap, sinks=sinks, mesh=ragged[0],
                                interpret=ragged[1], tiling=ragged[2])
    if counted is None:
        counted = t == 1 and counted_decode_loop()
    block = query_block_size(b, t, h, chunk, score_elements)
    if block >= t:
        return _attend_chunks(q, k_cache, v_cache, positions, chunk, counted, window, softcap=softcap, sinks=sinks)
    n = -(-t // block)  # query blocks; the padding queries sit at position -1 and attend nothing
    qs = jnp.pad(q, ((0, 0), (0, n * block - t), (0, 0), (0, 0))).reshape(b, n, block, h, dh).swapaxes(0, 1)
    ps = jnp.pad(positions, ((0, 0), (0, n * block - t)), constant_values=-1).reshape(b, n, block).swapaxes(0, 1)
    out = jax.lax.map(lambda qp: _attend_chunks(qp[0], k_cache, v_cache, qp[1], chunk, counted, window,
                                                softcap=softcap, sinks=sinks), (qs, ps))
    return out.swapaxes(0, 1).reshape(b, n * block, h, dh)[:, :t]


def window_span(window: int) -> int:
    """Cache positions a decode query of a sliding layer reads: its window, rounded up to a multiple of 8."""
    return -(-int(window) // 8) * 8


def window_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                            window: int, softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """`cached_attention` of one query per row in a sliding layer: each row reads only the `window_span` cache
    positions ending at its own position (one gather per row), so the cost follows the window, not the context
    or the cache's length. q: [B, 1, H, Dh]; positions [B, 1]."""
    b, s = k_cache.shape[:2]
    span = min(s, window_span(window))
    start = jnp.clip(positions[:, 0] - span + 1, 0, s - span)  # [B]
    index = start[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]  # [B, span]
    rows = jnp.arange(b)[:, None]
    return _attend_chunks(q, k_cache[rows, index], v_cache[rows, index], positions - start[:, None], span,
                          window=window, softcap=softcap, sinks=sinks)


def ring_attention(q: jax.Array, k_ring: jax.Array, v_ring: jax.Array, positions: jax.Array,
                   window: int, softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """`cached_attention` of one query per row in a sliding layer whose cache is a ring: k_ring, v_ring
    [B, R, K, Dh] hold position p at index p % R (R >= window, or R >= every position the row reaches:
    `ring_length`), so a row keeps only its last R positions whatever its length. Index j holds, for a query at position p, position p - ((p - j) % R); it is
    read where that is >= 0 and within the window. The ring is read in place, in index order (attention does
    not depend on the keys' order), every chunk of it. q: [B, 1, H, Dh]; positions [B, 1]."""
    b, t = positions.shape
    r = k_ring.shape[1]
    if t != 1:
        raise ValueError(f"ring_attention takes one query per row (decode), got {t}: a longer call would "
                         "overwrite positions its own queries read; prefill into a full-length cache instead.")
    return _attend_chunks(q, k_ring, v_ring, positions, cache_chunk_size(r), counted=True, window=window, ring=True,
                          softcap=softcap, sinks=sinks)


def ring_length(window: int, max_len: int) -> int:
    """Positions of a sliding layer's ring cache for sequences of up to max_len: its window rounded up to a
    multiple of 8 (`window_span`), or max_len when that is shorter (then no position ever wraps)."""
    return min(int(max_len), window_span(window))


def _attend_chunks(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                   chunk: int, counted: bool = False, window: int | None = None, ring: bool = False,
                   softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """`cached_attention` of one block of queries, `chunk` cache positions per step (every chunk when
    ``counted``, else from the chunk of the smallest position's window start up to that of the largest
    position). ring: the cache is a ring (`ring_attention`; every chunk is read). sinks: [H] or None, the
    running max and sum's start (`attention_sinks.sink_start`)."""
    b, t, h, dh = q.shape
    s, kv = k_cache.shape[1], k_cache.shape[2]
    qg = _group_queries(q, kv)
    group = h // kv
    scale = np.float32(1.0 / math.sqrt(dh))
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    if use_block_diagonal_queries(t, kv):
        qbd = jnp.einsum("btkgd,jk->bjdkgt", qg, jnp.eye(kv, dtype=qg.dtype)).reshape(b, kv * dh, kv * group * t)

        def chunk_attention(k: jax.Array, v: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
            return _chunk_attention_block_diagonal(qbd, k, v, (b, kv, group, t, dh), scale)
    else:
        def chunk_attention(k: jax.Array, v: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
            return _chunk_attention_grouped(qg, k, v, scale)

    def step(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        run_max, run_sum, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, Dh] float32
        first = c * chunk
        start = jnp.minimum(first, s - chunk)  # the last chunk is shifted back to stay inside the cache ...
        if chunk >= s:
            k, v = k_cache, v_cache
        else:
            k = jax.lax.dynamic_slice(k_cache, (0, start, 0, 0), (b, chunk, kv, dh))
            v = jax.lax.dynamic_slice(v_cache, (0, start, 0, 0), (b, chunk, kv, dh))
        index = start + offsets
        # ... and masks the indices that an earlier chunk covered.
        held = index[None, None, :]  # [1, 1, C] the position each index holds
        if ring:
            held = positions[:, :, None] - jnp.remainder(positions[:, :, None] - held, s)
            visible = (held >= 0) & (index >= first)[None, None, :]
        else:
            visible = (held <= positions[:, :, None]) & (index >= first)[None, None, :]  # [B, T, C]
        if window is not None:
            visible = visible & (held > positions[:, :, None] - window)
        visible = visible[:, None, None]
        scores, weigh_values = chunk_attention(k, v)
        scores = jnp.where(visible, soft_cap(scores, softcap), MASK_VALUE)
        new_max = jnp.maximum(run_max, jnp.max(scores, axis=-1))
        probs = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
        rescale = jnp.exp(run_max - new_max)
        run_sum = run_sum * rescale + jnp.sum(probs, axis=-1)
        return new_max, run_sum, acc * rescale[..., None] + weigh_values(probs)

    init = (*sink_start(sinks, (b, kv, group, t), MASK_VALUE), jnp.zeros((b, kv, group, t, dh), jnp.float32))
    if chunk >= s:
        # One pass over the layer (the accelerator default up to 8192 positions): no loop at all. A
        # data-dependent loop costs a device -> host round trip per trip on GPUs (the loop condition is
        # read by the host), once per layer per decode step.
        _, run_sum, acc = step(jnp.int32(0), init)
    elif counted:
        _, run_sum, acc = jax.lax.fori_loop(0, -(-s // chunk), step, init)
    else:
        last = jnp.clip(jnp.max(positions), 0, s - 1)
        lo = 0 if window is None else jnp.clip(jnp.min(jnp.where(positions >= 0, positions, last)) - window + 1,
                                               0, last) // chunk
        _, run_sum, acc = jax.lax.fori_loop(lo, last // chunk + 1, step, init)
    out = jnp.where(run_sum[..., None] > 0, acc / jnp.maximum(run_sum, 1e-30)[..., None], 0.0)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh).astype(q.dtype)
