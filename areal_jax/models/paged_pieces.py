"""Paged decode attention for head widths Triton's power-of-two blocks cannot hold (a Pallas kernel).

JAX's GPU paged-attention kernel loads a head's keys as one [positions, head_dim] block, and Triton's blocks have
power-of-two sides, so it refuses latent attention's 576 (DeepSeek's cache: a 512-wide latent and a 64-wide rotary
key, the keys serving as values) and Phi-3's 96. This kernel cuts the width into power-of-two pieces of at least
MIN_PIECE (576 = 512 + 64, 96 = 64 + 32, 80 = 64 + 16), loads each piece of a block of pages as its own tile, sums
the pieces' products into the scores and multiplies the probabilities by each piece of the values: the same
attention, its tiles legal for Triton.

The pages are read in place through the page table, as JAX's kernel does (the gather path instead copies each row's
pages into a contiguous view first: on an accelerator, two more passes over the cache a step). Grid: (rows,
kv heads x query-head blocks of BLOCK_H, splits of the row's pages); each program runs a float32 online softmax over
its split's pages, pages_per_block pages at a time, stops at the row's length, and writes its unnormalised output
with its running max and sum; the splits are combined outside the kernel. All query heads of a kv head in one
block share each page read (latent attention has one kv head for every query head: BLOCK_H heads per read).

Written for the Pallas Triton lowering on NVIDIA GPUs; `interpret=True` runs the same code on any backend (the CPU
tests compare it with the gather path).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from areal_jax.models.flash_attention import _dot, _dot_nt
from areal_jax.models.layers import MASK_VALUE
from areal_jax.models.ragged_decode import combine_splits

MIN_PIECE = 16  # Triton's dot takes no smaller contraction
BLOCK_H = 16
TILE_ELEMENTS = 16384  # a block of pages' keys at most this many elements (JAX's kernel: 8 pages x 16 x 128)


def pieces(width: int) -> tuple[tuple[int, int], ...]:
    """(start, size) of the power-of-two pieces of a head width, largest first: 576 -> ((0, 512), (512, 64)). The
    width must be a multiple of MIN_PIECE."""
    if width < MIN_PIECE or width % MIN_PIECE:
        raise ValueError(f"the pieced paged-attention kernel needs a head width that is a multiple of {MIN_PIECE}, got "
                         f"{width}; use the gather path (PagedEngine(attention='gather')).")
    out, start, size = [], 0, 1 << (width.bit_length() - 1)
    while start < width:
        if width - start >= size:
            out.append((start, size))
            start += size
        size //= 2
    return tuple(out)


def supports(width: int) -> bool:
    """Whether the kernel takes a head of this width."""
    return width >= MIN_PIECE and width % MIN_PIECE == 0


def _kernel(q_ref, k_ref, v_ref, table_ref, length_ref, o_ref, m_ref, l_ref, *, k_pieces, v_pieces,
            pages_per_block, softcap):
    """q_ref [BLOCK_H, Dh] (scaled); k_ref [N, ps, Dh] and v_ref [N, ps, Dv]: one kv head's pages; table_ref
    [pages per split]: this split's pages of the row (>= 0); length_ref [1]: the row's visible positions."""
    split = pl.program_id(2)
    block_h = q_ref.shape[0]
    page_size = k_ref.shape[1]
    per_split = table_ref.shape[0]
    block_k = pages_per_block * page_size
    length = length_ref[0]
    first = split * per_split
    end = jnp.minimum(pl.cdiv(length, page_size), first + per_split)  # pages past the row's length hold nothing
    qs = [q_ref[:, pl.ds(start, size)] for start, size in k_pieces]

    def body(j, carry):
        m_prev, l_prev, accs = carry
        pages = table_ref[pl.ds(j * pages_per_block, pages_per_block)]
        s = None
        for q, (start, size) in zip(qs, k_pieces):
            k = k_ref[pages, :, pl.ds(start, size)].reshape(block_k, size)
            s = _dot_nt(q, k) if s is None else s + _dot_nt(q, k)
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        position = (first + j * pages_per_block) * page_size + jnp.arange(block_k, dtype=jnp.int32)
        s = jnp.where((position < length)[None, :], s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        l_next = correction * l_prev + p.sum(axis=1)
        new = []
        for acc, (start, size) in zip(accs, v_pieces):
            v = v_ref[pages, :, pl.ds(start, size)].reshape(block_k, size)
            new.append(correction[:, None] * acc + _dot(p.astype(v.dtype), v))
        return m_next, l_next, tuple(new)

    init = (jnp.full((block_h,), jnp.finfo(jnp.float32).min, jnp.float32), jnp.zeros((block_h,), jnp.float32),
            tuple(jnp.zeros((block_h, size), jnp.float32) for _, size in v_pieces))
    blocks = pl.cdiv(jnp.maximum(end - first, 0), pages_per_block)
    m, l_sum, accs = lax.fori_loop(0, blocks, body, init)
    for acc, (start, size) in zip(accs, v_pieces):
        o_ref[:, pl.ds(start, size)] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


def power_of_two_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n and at most cap (a count of pages per split or per block)."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


@functools.partial(jax.jit, static_argnames=("softcap", "splits", "pages_per_block", "interpret"))
def pieced_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, table: jax.Array,
                           lengths: jax.Array, *, softcap: float | None = None, splits: int | None = None,
                           pages_per_block: int | None = None, interpret: bool = False) -> jax.Array:
    """One query per row over paged keys and values. q [B, H, Dh] (already scaled); k_pages [K, N, ps, Dh]; v_pages
    [K, N, ps, Dv] (the key pages themselves where the keys serve as values); table [B, P] int32 (every entry a
    page, >= 0); lengths [B] int32: row b attends its positions 0..lengths[b] - 1 (0: zeros). Dh and Dv multiples of
    MIN_PIECE. splits (default up to 16) must divide P, pages_per_block the pages of a split (default up to 8, fewer
    where a block's keys would pass TILE_ELEMENTS).
    Returns [B, H, Dv] in q's dtype."""
    b, h, dh = q.shape
    kv, _, page_size, dv = v_pages.shape
    per_row = table.shape[1]
    k_pieces, v_pieces = pieces(dh), pieces(dv)
    splits = power_of_two_divisor(per_row, 16) if splits is None else splits
    per_split = per_row // splits
    if pages_per_block is None:  # a block's widest tile at most TILE_ELEMENTS (shared memory: two stages of it)
        pages_per_block = power_of_two_divisor(per_split, max(1, TILE_ELEMENTS // (page_size * max(dh, dv))))
    if per_row % splits or per_split % pages_per_block:
        raise ValueError(f"splits={splits} must divide the {per_row} pages per row, and pages_per_block="
                         f"{pages_per_block} the {per_split} pages per split.")
    group = h // kv
    padded = -(-group // BLOCK_H) * BLOCK_H
    heads = padded // BLOCK_H
    qg = q.reshape(b, kv, group, dh)
    if padded != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded - group), (0, 0)))
    kernel = functools.partial(_kernel, k_pieces=k_pieces, v_pieces=v_pieces, pages_per_block=pages_per_block,
                               softcap=softcap)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=4 if max(dh, dv) <= 128 else 8, num_stages=2)
    o, m, l_sum = pl.pallas_call(
        kernel,
        grid=(b, kv * heads, splits),
        in_specs=[
            pl.BlockSpec((None, None, BLOCK_H, dh), lambda r, g, s: (r, g // heads, g % heads, 0)),
            pl.BlockSpec((None, k_pages.shape[1], page_size, dh), lambda r, g, s: (g // heads, 0, 0, 0)),
            pl.BlockSpec((None, v_pages.shape[1], page_size, dv), lambda r, g, s: (g // heads, 0, 0, 0)),
            pl.BlockSpec((None, None, per_split), lambda r, g, s: (r, s, 0)),
            pl.BlockSpec((None, 1), lambda r, g, s: (r, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, BLOCK_H, dv), lambda r, g, s: (s, r, g // heads, g % heads, 0)),
            pl.BlockSpec((None, None, None, BLOCK_H), lambda r, g, s: (s, r, g // heads, g % heads)),
            pl.BlockSpec((None, None, None, BLOCK_H), lambda r, g, s: (s, r, g // heads, g % heads)),
        ],
        out_shape=[jax.ShapeDtypeStruct((splits, b, kv, padded, dv), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, kv, padded), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, kv, padded), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="pieced_paged_attention",
    )(qg, k_pages, v_pages, table.reshape(b, splits, per_split).astype(jnp.int32),
      lengths.reshape(b, 1).astype(jnp.int32))
    out = combine_splits(o, m, l_sum, normalised=False)  # each split's unnormalised sum
    return out[:, :, :group].reshape(b, h, dv).astype(q.dtype)
