"""Flash attention for packed training rows: a Pallas kernel with segment ids, causal mask and GQA.

Memory grows linearly in the row length: scores exist only as [block_q, block_k] tiles inside the
kernel, forward and backward. A query at position i attends key j iff j <= i and both carry the same
segment id (as `transformer.packed_mask`; padding is segment 0 and attends earlier padding).

Which key blocks a query block visits. Packing puts each sequence in one contiguous run, so most
key blocks of a long row hold nothing a given query block may see. For every position the wrapper
computes the first and the last position holding the same segment id (`segment_bounds`); query
block i then loops over key blocks from (earliest first position of its queries) // block_k up to
the causal diagonal, and the backward's key block j loops over query blocks from its diagonal up to
(latest last position of its keys) // block_q. The bounds are exact for any segment ids (repeated,
non-contiguous ids only make the loops longer); the mask inside a tile does the rest. A row of
sequences of length n costs O(T * n) work rather than O(T^2). A sliding window of w positions (Mistral, Gemma 3)
narrows both loops to the blocks the window reaches: O(T * min(n, w)).

Kernels (written for the Pallas Triton lowering on NVIDIA GPUs; `interpret=True` runs the same code
on any backend, which is how CPU tests execute them):
  * forward: grid (query blocks, batch, query heads); online softmax in float32; writes the output
    and the log-sum-exp per query. Attention sinks (`attention_sinks`) start the online softmax (running max
    the head's sink logit, running sum 1), so the output and the log-sum-exp include the sink.
  * backward, flash-attention-2 style, two kernels: dq (grid over query blocks, like the forward),
    and dk / dv (grid over key blocks), recomputing each tile's probabilities from the saved
    log-sum-exp (with sinks, the sink-inclusive one and output: dS = P (dP - D) holds as it is, the sink's value
    being zero; a sink's own gradient, -sum exp(sink - lse) D over its queries, is summed outside). Grouped-query
    attention: a query head h reads key/value head h // group through the BlockSpec index map (keys are never
    repeated); dk / dv come out per query head in float32 and are summed over each group outside the kernel
    (memory [B, T, H, Dh], linear in T).

Why not `jax.experimental.pallas.ops.gpu.attention.mha`: it takes segment ids and a causal flag and
has a Triton backward, but needs as many key/value heads as query heads (GQA would repeat keys
and values H / K times) and visits every key block below the diagonal however short the packed
sequences are. `jax.nn.dot_product_attention(implementation="cudnn")` expresses padding by
sequence lengths but not several sequences in one row (only through a dense [T, T] mask).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from areal_jax.models.layers import MASK_VALUE

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64


def segment_bounds(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """segment_ids: [B, T] int -> (first, last): [B, T] int32, the first and the last position of each
    row holding the same segment id as position t. O(T log T) (a stable sort per row)."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    t = seg.shape[1]

    def one_row(row: jax.Array) -> tuple[jax.Array, jax.Array]:
        order = jnp.argsort(row, stable=True)
        ids = row[order]
        idx = jnp.arange(t, dtype=jnp.int32)
        starts = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])
        ends = jnp.concatenate([ids[1:] != ids[:-1], jnp.ones((1,), bool)])
        start_at = lax.cummax(jnp.where(starts, idx, 0))
        end_at = lax.cummin(jnp.where(ends, idx, t - 1), reverse=True)
        first = jnp.zeros(t, jnp.int32).at[order].set(order[start_at].astype(jnp.int32))
        last = jnp.zeros(t, jnp.int32).at[order].set(order[end_at].astype(jnp.int32))
        return first, last

    return jax.vmap(one_row)(seg)


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, d] . b [n, d]^T -> [m, n] float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, n]^T . b [m, d] -> [n, d] float32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, n] . b [n, d] -> [m, d] float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _tile_mask(seg_q: jax.Array, seg_k: jax.Array, q0: jax.Array, k0: jax.Array, window: int = 0) -> jax.Array:
    """[bq, bk] bool: same segment and key position <= query position (tiles starting at q0, k0), and with a
    sliding window (window > 0) query position - key position < window."""
    pos_q = q0 + jnp.arange(seg_q.shape[0], dtype=jnp.int32)
    pos_k = k0 + jnp.arange(seg_k.shape[0], dtype=jnp.int32)
    mask = (seg_q[:, None] == seg_k[None, :]) & (pos_q[:, None] >= pos_k[None, :])
    if window:
        mask = mask & (pos_q[:, None] - pos_k[None, :] < window)
    return mask


def _first_key_block(first_ref, q0, block_k: int, window: int):
    """The first key block a query block starting at q0 may see: that of its earliest segment start, or with a
    sliding window that of its first query's window start when later."""
    lo = jnp.min(first_ref[...])
    if window:
        lo = jnp.maximum(lo, q0 - window + 1)
    return lax.div(lo, block_k)


def _capped(s: jax.Array, softcap: float) -> jax.Array:
    """Gemma 2's soft-capping of scaled scores, softcap * tanh(s / softcap) (0: none)."""
    return jnp.tanh(s / softcap) * softcap if softcap else s


def _forward_kernel(*refs, scale: float, block_q: int, block_k: int, window: int, softcap: float, sinks: bool):
    """refs: q, k, v, segment ids, first positions, with sinks the head's sink logit [block_q] (repeated); then the
    outputs o and lse."""
    q_ref, k_ref, v_ref, seg_ref, first_ref = refs[:5]
    o_ref, lse_ref = refs[-2:]
    i = pl.program_id(0)
    q0 = i * block_q
    q = q_ref[...]
    seg_q = seg_ref[pl.ds(q0, block_q)]
    lo = _first_key_block(first_ref, q0, block_k, window)
    hi = lax.div(q0 + block_q + block_k - 1, block_k)

    def body(j, carry):
        acc, m, l = carry
        k0 = j * block_k
        keys = pl.ds(k0, block_k)
        s = _capped(_dot_nt(q, k_ref[keys, :]) * scale, softcap)
        mask = _tile_mask(seg_q, seg_ref[keys], q0, k0, window)
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, MASK_VALUE), axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        keep = jnp.exp(m - m_new)
        v = v_ref[keys, :]
        return acc * keep[:, None] + _dot(p.astype(v.dtype), v), m_new, l * keep + jnp.sum(p, axis=1)

    if sinks:  # the sink seen first: running max its logit, running sum exp(0)
        start = (refs[5][...].astype(jnp.float32), jnp.ones((block_q,), jnp.float32))
    else:
        start = (jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    init = (jnp.zeros(q.shape, jnp.float32), *start)
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(q_ref, k_ref, v_ref, seg_ref, first_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale: float,
               block_q: int, block_k: int, window: int, softcap: float):
    i = pl.program_id(0)
    q0 = i * block_q
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    seg_q = seg_ref[pl.ds(q0, block_q)]
    lo = _first_key_block(first_ref, q0, block_k, window)
    hi = lax.div(q0 + block_q + block_k - 1, block_k)

    def body(j, dq):
        k0 = j * block_k
        keys = pl.ds(k0, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        mask = _tile_mask(seg_q, seg_ref[keys], q0, k0, window)
        s = _capped(_dot_nt(q, k) * scale, softcap)
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        ds = p * (_dot_nt(do, v) - delta[:, None])
        if softcap:  # d(capped)/d(s) = 1 - tanh^2
            ds = ds * (1.0 - jnp.square(s / softcap))
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, seg_ref, last_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                scale: float, block_q: int, block_k: int, window: int, softcap: float):
    j = pl.program_id(0)
    k0 = j * block_k
    k, v = k_ref[...], v_ref[...]
    seg_k = seg_ref[pl.ds(k0, block_k)]
    lo = lax.div(k0, block_q)
    last = jnp.max(last_ref[...])
    if window:  # the last query whose window reaches this block's last key
        last = jnp.minimum(last, k0 + block_k - 1 + window - 1)
    hi = lax.div(last, block_q) + 1

    def body(i, carry):
        dk, dv = carry
        q0 = i * block_q
        rows = pl.ds(q0, block_q)
        q, do = q_ref[rows, :], do_ref[rows, :]
        mask = _tile_mask(seg_ref[rows], seg_k, q0, k0, window)
        s = _capped(_dot_nt(q, k) * scale, softcap)
        p = jnp.where(mask, jnp.exp(s - lse_ref[rows][:, None]), 0.0)
        dv = dv + _dot_tn(p.astype(do.dtype), do)
        ds = p * (_dot_nt(do, v) - delta_ref[rows][:, None])
        if softcap:
            ds = ds * (1.0 - jnp.square(s / softcap))
        return dk + _dot_tn(ds.astype(q.dtype), q), dv

    zeros = jnp.zeros((block_k, k.shape[1]), jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _compiler_params(interpret: bool, head_dim: int):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _forward(q, k, v, seg, first, sinks, *, scale, block_q, block_k, window, softcap, interpret):
    b, t, h, dh = q.shape
    group = h // k.shape[2]
    row = lambda i, bi, hi: (bi, 0)  # noqa: E731
    extra, extra_specs = [], []
    if sinks is not None:  # [H] -> [H, block_q]: each head's logit as a row of the queries' running max
        extra = [jnp.broadcast_to(sinks[:, None], (h, block_q))]
        extra_specs = [pl.BlockSpec((None, block_q), lambda i, bi, hi: (hi, 0))]
    o, lse = pl.pallas_call(
        functools.partial(_forward_kernel, scale=scale, block_q=block_q, block_k=block_k, window=window,
                          softcap=softcap, sinks=sinks is not None),
        grid=(t // block_q, b, h),
        in_specs=[
            pl.BlockSpec((None, block_q, None, dh), lambda i, bi, hi: (bi, i, hi, 0)),
            pl.BlockSpec((None, t, None, dh), lambda i, bi, hi: (bi, 0, hi // group, 0)),
            pl.BlockSpec((None, t, None, dh), lambda i, bi, hi: (bi, 0, hi // group, 0)),
            pl.BlockSpec((None, t), row),
            pl.BlockSpec((None, block_q), lambda i, bi, hi: (bi, i)),
            *extra_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, dh), lambda i, bi, hi: (bi, i, hi, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, bi, hi: (bi, hi, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
        compiler_params=_compiler_params(interpret, dh),
        interpret=interpret,
        name="packed_flash_forward",
    )(q, k, v, seg, first, *extra)
    return o, lse


def _backward(q, k, v, seg, first, last, lse, delta, do, *, scale, block_q, block_k, window, softcap, interpret):
    b, t, h, dh = q.shape
    kv = k.shape[2]
    group = h // kv
    whole_q = pl.BlockSpec((None, t, None, dh), lambda g, bi, hi: (bi, 0, hi, 0))
    whole_kv = pl.BlockSpec((None, t, None, dh), lambda g, bi, hi: (bi, 0, hi // group, 0))
    q_block = pl.BlockSpec((None, block_q, None, dh), lambda g, bi, hi: (bi, g, hi, 0))
    kv_block = pl.BlockSpec((None, block_k, None, dh), lambda g, bi, hi: (bi, g, hi // group, 0))
    row = pl.BlockSpec((None, t), lambda g, bi, hi: (bi, 0))
    per_head_row = pl.BlockSpec((None, None, t), lambda g, bi, hi: (bi, hi, 0))
    params = _compiler_params(interpret, dh)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_q=block_q, block_k=block_k, window=window, softcap=softcap),
        grid=(t // block_q, b, h),
        in_specs=[q_block, whole_kv, whole_kv, row, pl.BlockSpec((None, block_q), lambda g, bi, hi: (bi, g)),
                  q_block, pl.BlockSpec((None, None, block_q), lambda g, bi, hi: (bi, hi, g)),
                  pl.BlockSpec((None, None, block_q), lambda g, bi, hi: (bi, hi, g))],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="packed_flash_dq",
    )(q, k, v, seg, first, do, lse, delta)
    dk_heads, dv_heads = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block_q=block_q, block_k=block_k, window=window,
                          softcap=softcap),
        grid=(t // block_k, b, h),
        in_specs=[whole_q, kv_block, kv_block, row, pl.BlockSpec((None, block_k), lambda g, bi, hi: (bi, g)),
                  whole_q, per_head_row, per_head_row],
        out_specs=[pl.BlockSpec((None, block_k, None, dh), lambda g, bi, hi: (bi, g, hi, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="packed_flash_dkv",
    )(q, k, v, seg, last, do, lse, delta)
    dk = dk_heads.reshape(b, t, kv, group, dh).sum(axis=3).astype(k.dtype)
    dv = dv_heads.reshape(b, t, kv, group, dh).sum(axis=3).astype(v.dtype)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _flash(q, k, v, seg, first, last, sinks, scale, block_q, block_k, window, softcap, interpret):
    return _forward(q, k, v, seg, first, sinks, scale=scale, block_q=block_q, block_k=block_k, window=window,
                    softcap=softcap, interpret=interpret)[0]


def _flash_fwd(q, k, v, seg, first, last, sinks, scale, block_q, block_k, window, softcap, interpret):
    o, lse = _forward(q, k, v, seg, first, sinks, scale=scale, block_q=block_q, block_k=block_k, window=window,
                      softcap=softcap, interpret=interpret)
    return o, (q, k, v, seg, first, last, sinks, o, lse)


def _flash_bwd(scale, block_q, block_k, window, softcap, interpret, res, do):
    q, k, v, seg, first, last, sinks, o, lse = res
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)  # [B, H, T]
    dq, dk, dv = _backward(q, k, v, seg, first, last, lse, delta, do, scale=scale, block_q=block_q,
                           block_k=block_k, window=window, softcap=softcap, interpret=interpret)
    # the sink's probability exp(sink - lse) times dP - D, its dP being 0 (value zero)
    dsinks = None if sinks is None else -jnp.sum(jnp.exp(sinks[None, :, None] - lse) * delta, axis=(0, 2))
    return dq, dk, dv, None, None, None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                    block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
                    interpret: bool | None = None, window: int | None = None,
                    softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention of packed rows, differentiable in q, k, v (and sinks).

    q: [B, T, H, Dh]; k, v: [B, T, K, Dh] (H a multiple of K); segment_ids: [B, T] int (i attends j iff
    j <= i and both have the same id). Returns [B, T, H, Dh] in q's dtype; the softmax, its statistics
    and the gradient accumulators are float32. block_q, block_k: tile sizes (powers of two, at least
    16 for the Triton lowering). T is padded up to a multiple of both and head_dim to a power of two
    inside (padding gets its own segment). interpret: run the Pallas interpreter (default: on any
    backend but GPU). window: a sliding window (i also needs i - j < window); each query block then visits
    only the key blocks its window reaches. softcap: Gemma 2's softcap * tanh(s / softcap) of the scaled
    scores (the backward multiplies by its derivative, 1 - tanh^2). sinks: [H] each query head's sink logit
    (`attention_sinks`; kept in float32), or None.
    """
    b, t, h, dh = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != dh or h % k.shape[2]:
        raise ValueError(f"flash_attention: q {q.shape}, k {k.shape}, v {v.shape}; expected q [B, T, H, Dh] and "
                         "k, v [B, T, K, Dh] with H a multiple of K.")
    if segment_ids.shape != (b, t):
        raise ValueError(f"flash_attention: segment_ids has shape {segment_ids.shape}, expected {(b, t)}.")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"flash_attention: sinks has shape {sinks.shape}, expected one logit per query head {(h,)}.")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"flash_attention: {name}={size} must be a power of two.")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    scale = 1.0 / math.sqrt(dh)
    step = max(block_q, block_k)
    t_pad = -(-t // step) * step
    d_pad = max(16, 1 << (dh - 1).bit_length())
    seg = jnp.asarray(segment_ids, jnp.int32)
    if t_pad != t or d_pad != dh:
        widths = ((0, 0), (0, t_pad - t), (0, 0), (0, d_pad - dh))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        pad_id = jnp.min(seg) - 1  # a segment of its own: padded queries see only padding
        seg = jnp.concatenate([seg, jnp.broadcast_to(pad_id, (b, t_pad - t))], axis=1)
    first, last = segment_bounds(seg)
    if window is not None and window < 1:
        raise ValueError(f"flash_attention: window={window} must be a positive number of positions (or None).")
    sinks = None if sinks is None else sinks.astype(jnp.float32)
    out = _flash(q, k, v, seg, first, last, sinks, float(np.float32(scale)), block_q, block_k, int(window or 0),
                 float(softcap or 0.0), bool(interpret))
    return out[:, :t, :, :dh]
