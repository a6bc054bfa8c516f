"""Decode attention over the dense KV cache that reads each row only up to its own length (a Pallas kernel).

The dense cache holds [rows, max_len] positions per layer. XLA's decode path (`cache_attention.cached_attention`)
reads all max_len of them on GPUs, for every row, every step: a loop that stopped at the batch's longest row would
be a loop whose trip count the host reads before each trip, and in a batch of many rows one row mostly sits near
the end anyway. An H100 trace of the Qwen2.5-0.5B sampler at 256 slots had the two attention products read the
whole 1,152-position cache (about 33 us each a layer) while the rows held about 400 positions on average: a third
of those bytes were live.

This kernel reads row b's keys and values only at positions 0..lengths[b] - 1, in place, in blocks of BLOCK
positions, with a float32 online softmax; the loop's trip count lives on the device, so nothing waits for the
host. Grid: (rows, kv heads x query-head blocks of BLOCK_H, splits of the positions). All query heads of a kv
head share each block read (grouped-query attention reads each key once). A block is a [BLOCK, head_dim] tile of
one kv head, strided in the cache's [B, S, K, Dh] layout (head_dim contiguous), so the layer is never copied or
transposed. Splits (flash-decoding) give short batches enough programs; their partial results are combined
outside the kernel (`combine_splits`). With one split (the usual case at 256 slots) the kernel writes the output
itself; attention sinks (gpt-oss) join the softmax where the splits are combined.

Written for the Pallas Triton lowering on NVIDIA GPUs (head widths powers of two, at least 16); off GPUs the same code
runs in the Pallas interpreter (`interpret`'s default there: the CPU tests compare it with `cached_attention`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from areal_jax.models.flash_attention import _dot, _dot_nt
from areal_jax.models.layers import MASK_VALUE

BLOCK_H = 16  # query heads of one kv head per program (Triton's dot takes no fewer rows)
MAX_BLOCK = 128  # cache positions a program reads at once
TILE_ELEMENTS = 16384  # a block's keys at most this many elements (two pipeline stages of them in shared memory)
PROGRAMS = 512  # rows x kv-head blocks x splits the grid aims at: about four programs for each of an H100's 132 SMs
DECODE_PATHS = ("auto", "xla", "kernel")


def decode_path(choice: str, backend: str | None = None) -> str:
    """A dense-cache sampler's decode attention, checked: "xla" (``cache_attention.cached_attention``), "kernel"
    (this module; GPUs, or the Pallas interpreter on the CPU: correct but slow, for tests) or "auto" (the faster of
    the two, measured: ``sampler.decode_choice``). A TPU runs no Triton kernel: there the paged cache's Mosaic
    kernel reads each row up to its length."""
    if choice not in DECODE_PATHS:
        raise ValueError(f"decode_attention={choice!r} is not one of {DECODE_PATHS}.")
    if choice == "kernel" and (jax.default_backend() if backend is None else backend) == "tpu":
        raise ValueError("decode_attention='kernel' is a GPU (Triton) kernel; on TPUs use decode_attention='xla', or "
                         "kv_cache='paged', whose Mosaic kernel reads each row up to its own length.")
    return choice


def supports(head_dim: int, value_dim: int, max_len: int) -> bool:
    """Whether the kernel takes a cache of these widths and length: head widths powers of two of at least 16
    (Triton's blocks), and at least 16 positions."""
    def fits(width: int) -> bool:
        return width >= 16 and width & (width - 1) == 0

    return fits(head_dim) and fits(value_dim) and max_len >= 16


def blocks_per_row(max_len: int, block: int) -> int:
    """Blocks of `block` positions that cover max_len."""
    return -(-max_len // block)


def tiling(rows: int, programs_per_row: int, max_len: int, width: int) -> tuple[int, int, int]:
    """(block, splits, positions per split) for `rows` rows of `programs_per_row` programs each over a cache of
    max_len positions whose widest head is `width`. block: the largest power of two within MAX_BLOCK, max_len
    and TILE_ELEMENTS / width; splits: a power of two, doubled (up to 16) while the grid holds fewer than PROGRAMS
    programs and each split keeps a block; each split a multiple of the block."""
    block = min(MAX_BLOCK, max_len, max(16, TILE_ELEMENTS // width))
    block = 1 << (block.bit_length() - 1)
    blocks = blocks_per_row(max_len, block)
    splits = 1
    while splits < 16 and rows * programs_per_row * splits < PROGRAMS and splits * 2 <= blocks:
        splits *= 2
    return block, splits, -(-blocks // splits) * block


def default_tiling(rows: int, heads: int, kv_heads: int, max_len: int, width: int) -> tuple[int, int, int]:
    """`tiling` of the kernel's grid for `rows` rows of `heads` query heads over `kv_heads` kv heads: each row has
    kv_heads x ceil(group / BLOCK_H) programs."""
    return tiling(rows, kv_heads * -(-(heads // kv_heads) // BLOCK_H), max_len, width)


def _kernel(length_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block, per_split, scale, softcap):
    """length_ref [1]: the row's visible positions; q_ref [BLOCK_H, Dh]; k_ref [S, Dh] and v_ref [S, Dv]: one kv
    head's positions of one row (strided views of the cache). Writes this split's output (normalised), its
    running max and its sum."""
    split = pl.program_id(2)
    s = k_ref.shape[0]
    first = split * per_split
    end = jnp.minimum(length_ref[0], first + per_split)
    q = q_ref[...]
    offsets = jnp.arange(block, dtype=jnp.int32)

    def body(j, carry):
        m_prev, l_prev, acc = carry
        start = first + j * block
        at = jnp.minimum(start, s - block)  # the last block is shifted back to stay inside the cache ...
        k = k_ref[pl.ds(at, block), :]
        v = v_ref[pl.ds(at, block), :]
        scores = _dot_nt(q, k.astype(q.dtype)) * scale
        if softcap:
            scores = softcap * jnp.tanh(scores / softcap)
        position = at + offsets
        visible = (position >= start) & (position < end)  # ... and masks what an earlier block covered
        scores = jnp.where(visible[None, :], scores, MASK_VALUE)
        m_next = jnp.maximum(m_prev, scores.max(axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(scores - m_next[:, None])
        l_next = correction * l_prev + p.sum(axis=1)
        return m_next, l_next, correction[:, None] * acc + _dot(p.astype(q.dtype), v.astype(q.dtype))

    rows = q.shape[0]
    init = (jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, v_ref.shape[1]), jnp.float32))
    m, l_sum, acc = lax.fori_loop(0, pl.cdiv(jnp.maximum(end - first, 0), block), body, init)
    o_ref[...] = (acc / jnp.maximum(l_sum, jnp.finfo(jnp.float32).tiny)[:, None]).astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l_sum


def combine_splits(o: jax.Array, m: jax.Array, l_sum: jax.Array, sinks: jax.Array | None = None,
                   normalised: bool = True) -> jax.Array:
    """Splits' outputs o [splits, ..., D] with their running maxima and sums m, l_sum [splits, ...] -> the attention
    over all of them, [..., D] float32 (zeros where no split saw a position). normalised: each split's o is its own
    softmax's output (this kernel's); else its unnormalised sum of exp(score - m) v (`paged_pieces`'). sinks: a logit
    per query, broadcasting to m[0] (`attention_sinks`: one more key of value zero), or None."""
    top = m.max(axis=0)
    if sinks is not None:
        top = jnp.maximum(top, sinks)
    scale = jnp.exp(m - top[None])  # a split that saw nothing has l = 0 (and o = 0)
    total = (l_sum * scale).sum(axis=0) + (0.0 if sinks is None else jnp.exp(sinks - top))
    out = (o.astype(jnp.float32) * (l_sum * scale if normalised else scale)[..., None]).sum(axis=0)
    return out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]


@functools.partial(jax.jit, static_argnames=("softcap", "block", "splits", "num_warps", "interpret"))
def ragged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
                            softcap: float | None = None, sinks: jax.Array | None = None, block: int | None = None,
                            splits: int | None = None, num_warps: int | None = None,
                            interpret: bool | None = None) -> jax.Array:
    """One query per row over one layer of the dense cache, each row read up to its own length.

    q: [B, H, Dh] (RoPE applied, not scaled); k_cache [B, S, K, Dh], v_cache [B, S, K, Dv]; lengths [B] int32: row
    b attends positions 0..lengths[b] - 1 (0: zeros; at most S). softcap: the scaled scores' `layers.soft_cap`;
    sinks: [H] each query head's sink logit (`attention_sinks`; joined where the splits are combined), or None.
    block / splits: the tiling (default `tiling`); num_warps: Triton's (default 4, 8 past 128-wide heads);
    interpret: run the Pallas interpreter (default: on any backend but GPU).
    Returns [B, H, Dv] in q's dtype."""
    b, h, dh = q.shape
    s, kv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    if not supports(dh, dv, s) or v_cache.shape[:3] != k_cache.shape[:3] or h % kv:
        raise ValueError(f"ragged_decode_attention takes heads of power-of-two widths >= 16 over >= 16 positions and "
                         f"query heads a multiple of kv heads; got q {q.shape}, keys {k_cache.shape}, values "
                         f"{v_cache.shape}. Use cached_attention (decode_attention='xla').")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    group = h // kv
    padded = -(-group // BLOCK_H) * BLOCK_H
    heads = padded // BLOCK_H
    default_block, default_splits, _ = default_tiling(b, h, kv, s, max(dh, dv))
    block = min(default_block if block is None else int(block), s)
    splits = default_splits if splits is None else int(splits)
    per_split = -(-blocks_per_row(s, block) // splits) * block
    qg = q.reshape(b, kv, group, dh)
    if padded != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded - group), (0, 0)))
    kernel = functools.partial(_kernel, block=block, per_split=per_split, scale=np.float32(1.0 / math.sqrt(dh)),
                               softcap=softcap)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=num_warps or (4 if max(dh, dv) <= 128 else 8), num_stages=2)
    whole = splits == 1 and sinks is None  # the kernel's output is the answer
    out_dtype = q.dtype if whole else jnp.float32
    o, m, l_sum = pl.pallas_call(
        kernel,
        grid=(b, kv * heads, splits),
        in_specs=[
            pl.BlockSpec((None, 1), lambda r, g, p: (r, 0)),
            pl.BlockSpec((None, None, BLOCK_H, dh), lambda r, g, p: (r, g // heads, g % heads, 0)),
            pl.BlockSpec((None, s, None, dh), lambda r, g, p: (r, 0, g // heads, 0)),
            pl.BlockSpec((None, s, None, dv), lambda r, g, p: (r, 0, g // heads, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, BLOCK_H, dv), lambda r, g, p: (p, r, g // heads, g % heads, 0)),
            pl.BlockSpec((None, None, None, BLOCK_H), lambda r, g, p: (p, r, g // heads, g % heads)),
            pl.BlockSpec((None, None, None, BLOCK_H), lambda r, g, p: (p, r, g // heads, g % heads)),
        ],
        out_shape=[jax.ShapeDtypeStruct((splits, b, kv, padded, dv), out_dtype),
                   jax.ShapeDtypeStruct((splits, b, kv, padded), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, kv, padded), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="ragged_decode_attention",
    )(jnp.clip(lengths, 0, s).reshape(b, 1).astype(jnp.int32), qg, k_cache, v_cache)
    if sinks is not None:  # [H] -> [B, K, padded] as the queries are laid out (padding heads: no sink)
        sinks = jnp.pad(sinks.astype(jnp.float32).reshape(kv, group), ((0, 0), (0, padded - group)),
                        constant_values=MASK_VALUE)[None]
    out = o[0] if whole else combine_splits(o, m, l_sum, sinks)
    return out[:, :, :group].reshape(b, h, dv).astype(q.dtype)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, *,
                     softcap: float | None = None, sinks: jax.Array | None = None,
                     mesh: jax.sharding.Mesh | None = None, interpret: bool | None = None,
                     tiling: tuple[int, int] | None = None) -> jax.Array:
    """`cache_attention.cached_attention` of one query per row through the kernel: q [B, 1, H, Dh]; positions
    [B, 1] (row b attends 0..positions[b]; none when negative, all S when >= S); sinks [H] or None. mesh: the
    sampler's; when its
    "tensor" axis divides both head counts (the cache splits its kv heads over it), the kernel runs in a shard_map
    on each device's heads (XLA cannot partition a Pallas call: it would gather every head to every device).
    tiling: (splits, block) of each device's call (default `tiling`). Returns [B, 1, H, Dv] in q's dtype."""
    s = k_cache.shape[1]
    lengths = jnp.clip(positions[:, 0] + 1, 0, s).astype(jnp.int32)

    def run(q, k, v, lengths, sinks):
        splits, block = (None, None) if tiling is None else tiling
        return ragged_decode_attention(q[:, 0], k, v, lengths, softcap=softcap, sinks=sinks, splits=splits,
                                       block=block, interpret=interpret)[:, None]

    tensor = int(mesh.shape.get("tensor", 1)) if mesh is not None else 1
    if tensor > 1 and k_cache.shape[2] % tensor == 0 and q.shape[2] % tensor == 0:
        heads = P(None, None, "tensor", None)
        run = jax.shard_map(run, mesh=mesh, in_specs=(heads, heads, heads, P(), None if sinks is None else
                                                      P("tensor")), out_specs=heads, check_vma=False)
    return run(q, k_cache, v_cache, lengths, sinks)
