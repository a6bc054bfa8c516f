"""Attention over packed rows that skips the key blocks no query of a block may see.

A packed training row holds several sequences; a query attends only earlier keys of its own sequence.
Dense attention over a row of T tokens costs T^2 per head however short the sequences are. Here the row
is cut into n blocks of `block` tokens and query block i visits key blocks j <= i (causality removes
the others statically); an off-diagonal pair (i, j) whose segment-and-causal mask is empty for every
row of the micro-batch is skipped at run time (`lax.cond`). Visited blocks are combined with an online
softmax (running max, running sum), so the result equals `layers.dot_attention` up to float rounding,
and so do the gradients (the backward pass takes the same branches).

Which blocks are visited depends only on the segment ids, so the model computes the block masks once
(`block_masks`) and every layer takes the same branches.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.attention_sinks import sink_start
from areal_jax.models.layers import MASK_VALUE, _group_queries, soft_cap

MIN_BLOCK = 128  # tokens per block at the least; a row of T tokens uses max(MIN_BLOCK, T // MAX_BLOCKS)
MAX_BLOCKS = 8  # blocks per row at the most: n (n + 1) / 2 block pairs are unrolled into the program


def attention_block(t: int, backend: str | None = None) -> int | None:
    """Block size for a row of `t` tokens, or None where dense attention is used: off the CPU, for a
    row of at most two minimum blocks, or a length the block does not divide.

    On the CPU the benchmark's PPO update (rows of 384 tokens) ran 1.09-1.13x faster blocked (3,131-3,236
    against 2,765-2,972 tokens/s, benchmarks/trainer.py, 2 cores, two runs each). On an H200 the same
    update ran 0.82x as fast blocked (139k against 170k tokens/s, one run each): the per-pair branches
    cost more than the skipped work there, so accelerators keep dense attention. backend defaults to
    jax.default_backend().
    """
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu":
        return None
    block = max(MIN_BLOCK, t // MAX_BLOCKS)
    if t % block or t // block < 3:
        return None
    return block


def block_masks(segment_ids: jax.Array, block: int,
                window: int | None = None) -> dict[tuple[int, int], tuple[jax.Array, jax.Array]]:
    """For each block pair (i, j), j <= i, of rows cut into `block`-token blocks that a sliding `window` (if
    any) does not rule out: the [B, block, block] mask (i attends j iff j <= i, both have the same segment id
    and i - j < window, as `transformer.packed_mask`) and whether any query of the micro-batch may attend that
    block (a scalar bool). Pairs farther apart than the window are left out (never visited)."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    n = seg.shape[1] // block
    offsets = jnp.arange(block)[:, None] - jnp.arange(block)[None, :]
    out = {}
    for i in range(n):
        for j in range(i + 1):
            if window is not None and (i - j - 1) * block + 1 >= window:
                continue  # the nearest query-key pair of these blocks is already out of the window
            same = seg[:, i * block:(i + 1) * block, None] == seg[:, None, j * block:(j + 1) * block]
            distance = offsets + (i - j) * block
            near = distance >= 0 if window is None else (distance >= 0) & (distance < window)
            mask = same if i != j and (window is None or (i - j + 1) * block - 1 < window) else same & near[None]
            out[i, j] = (mask, mask.any())
    return out


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, block: int,
                      masks: dict[tuple[int, int], tuple[jax.Array, jax.Array]] | None = None,
                      window: int | None = None, softcap: float | None = None,
                      sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention of packed rows, visiting only the key blocks some query may attend.

    q: [B, T, H, Dh]; k, v: [B, T, K, Dh]; segment_ids: [B, T] int (i attends j iff j <= i and both have
    the same id, as `transformer.packed_mask`); block: tokens per block, dividing T; masks: `block_masks`
    of those segment ids (and window), when the caller shares them between layers; window: a sliding window
    (i also needs i - j < window); softcap: the scaled scores' `layers.soft_cap`; sinks: [H] each query head's
    sink logit (`attention_sinks`: the online softmax starts from it), or None. Every query must be
    able to attend itself (true of that mask), so no row is left without keys.
    Returns [B, T, H, Dh] in q's dtype, float32 softmax like `layers.dot_attention`.
    """
    b, t, h, dh = q.shape
    if t % block:
        raise ValueError(f"blocked_attention: block {block} does not divide the row length {t}.")
    kv = k.shape[2]
    n = t // block
    qg = _group_queries(q, kv)  # [B, T, K, G, Dh]
    g = qg.shape[3]
    scale = np.float32(1.0 / math.sqrt(dh))
    masks = block_masks(segment_ids, block, window) if masks is None else masks

    outs = []
    for i in range(n):
        q_i = qg[:, i * block:(i + 1) * block]  # [B, bq, K, G, Dh]
        # running max, running sum of exp, running weighted values
        carry = (*sink_start(sinks, (b, kv, g, block), MASK_VALUE), jnp.zeros((b, kv, g, block, dh), jnp.float32))
        for j in range(i + 1):
            if (i, j) not in masks:
                continue  # out of the sliding window
            k_j = k[:, j * block:(j + 1) * block]
            v_j = v[:, j * block:(j + 1) * block]
            mask, any_visible = masks[i, j]

            def visit(c, q_i=q_i, k_j=k_j, v_j=v_j, mask=mask):
                m, l, acc = c
                s = soft_cap(jnp.einsum("btkgd,bskd->bkgts", q_i, k_j, preferred_element_type=jnp.float32) * scale,
                             softcap)
                s = jnp.where(mask[:, None, None], s, MASK_VALUE)
                m_new = jnp.maximum(m, s.max(axis=-1))
                p = jnp.exp(s - m_new[..., None])
                keep = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32)
                return m_new, l * keep + p.sum(axis=-1), acc * keep[..., None] + pv

            if i == j:  # the diagonal block holds every query itself
                carry = visit(carry)
            else:
                carry = jax.lax.cond(any_visible, visit, lambda c: c, carry)
        _, l, acc = carry
        out = acc / l[..., None]  # [B, K, G, bq, Dh]
        outs.append(out.transpose(0, 3, 1, 2, 4).reshape(b, block, h, dh))
    return jnp.concatenate(outs, axis=1).astype(q.dtype)
