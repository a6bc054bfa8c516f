"""A paged KV cache: fixed-size pages shared by every sequence, one page table per row.

A dense cache gives every decode slot [max_len] positions whether it uses them or not, so slots x max_len
bounds the batch. Here keys and values live in a pool of pages, per layer ``[K, num_pages, page_size, Dh]``
(the layout JAX's Pallas paged-attention kernels read; one buffer per layer, so a kernel reads its layer in
place rather than a slice copied out of a stack), and row b's position p lives at offset
``p % page_size`` of page ``page_table[b, p // page_size]``. Pages are handed out as a sequence grows
and returned when it finishes (``sampler.pages.PageAllocator``); a group's samples can point at the same
prompt pages.

Attention over pages has two paths with the semantics of ``cache_attention.cached_attention`` (a query at
position p attends positions 0..p of its row; p < 0 gives zeros):
- ``gather_attention``: gathers each row's pages into a contiguous [B, P * page_size] view (any backend,
  any number of queries per row; the CPU path);
- ``kernel_attention``: one query per row through JAX's Pallas paged-attention kernels, which read pages in
  place: on GPUs ``jax.experimental.pallas.ops.gpu.paged_attention`` (Triton), on TPUs
  ``jax.experimental.pallas.ops.tpu.paged_attention`` (Mosaic; head_dim a multiple of 128);
  ``interpret=True`` runs either kernel on the CPU. Neither takes attention sinks (`attention_sinks`) or returns
  its log-sum-exp, so a model with sinks reads its pages through the gather path.
``paged_hidden`` runs a ``Transformer``'s layers over a paged cache (the decode path of the model).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from areal_jax.models.attention_sinks import sink_softmax
from areal_jax.models.cache_attention import ring_attention, window_span
from areal_jax.models.config import ModelConfig
from areal_jax.models.layers import MASK_VALUE, soft_cap
from areal_jax.models.mla import cache_layout, cached_values
from areal_jax.models.paged_pieces import TILE_ELEMENTS, pieced_paged_attention, power_of_two_divisor
from areal_jax.models.rope import rope_tables
from areal_jax.models.transformer import (
    KVCache,
    LayerBuffers,
    cache_dtype,
    cache_lengths,
    cached_layer,
    stacked_routes,
    state_layer,
    zero_cache,
)

PagedPath = Literal["gather", "kernel"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache(LayerBuffers):
    """Keys and values of every layer in pages. k, v: tuples of L arrays [K, num_pages, page_size, Dh]
    (compute dtype); a layer whose rows live in rings instead (`paged_hidden`'s ``rings``) has no pages
    ([K, 0, page_size, Dh])."""

    @property
    def num_pages(self) -> int:
        return max(x.shape[1] for x in self.k)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any = None,
                     rings: tuple[int, ...] = ()) -> PagedKVCache:
    """A zero paged cache of ``num_pages`` pages of ``page_size`` positions; dtype defaults to
    ``transformer.cache_dtype(cfg)`` (float32 on the CPU). The entries in ``rings`` get no pages (their rows are
    rings: `init_rings`; a hybrid layer's state entry, `ModelConfig.state_entry`, is always one)."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"a paged cache needs num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}.")
    dtype = cache_dtype(cfg) if dtype is None else dtype
    heads, k_dim, v_dim = cache_layout(cfg)
    pages = [0 if i in rings else num_pages for i in range(cfg.cache_entries)]  # (hybrid layers' states: in rings)
    return PagedKVCache(k=tuple(jnp.zeros((heads, n, page_size, k_dim), dtype) for n in pages),
                        v=tuple(jnp.zeros((heads, n, page_size, v_dim), dtype) for n in pages))


def init_rings(cfg: ModelConfig, rows: int, max_len: int, rings: tuple[int, ...], dtype: Any = None) -> KVCache:
    """Ring rows beside a paged cache: the layers in ``rings`` (sliding layers, `transformer.ring_layers`) as a
    KVCache of [rows, ring_length, K, Dh], every other layer [rows, 0, K, Dh] (it lives in pages)."""
    lengths = cache_lengths(cfg, max_len, ring=True)
    return zero_cache(cfg, rows, [lengths[i] if i in rings else 0 for i in range(cfg.num_layers)], dtype)


def page_coordinates(page_table: jax.Array, positions: jax.Array, page_size: int,
                     num_pages: int) -> tuple[jax.Array, jax.Array]:
    """page_table [B, P] int32 (-1 = no page), positions [B, T] -> (page [B, T], offset [B, T]) int32.

    Positions outside [0, P * page_size) or on a missing page map to page ``num_pages`` (out of range:
    a write there is dropped)."""
    per_row = page_table.shape[1]
    slot = jnp.clip(positions // page_size, 0, per_row - 1)
    page = jnp.take_along_axis(page_table, slot, axis=1)
    ok = (positions >= 0) & (positions < per_row * page_size) & (page >= 0)
    return jnp.where(ok, page, num_pages).astype(jnp.int32), (positions % page_size).astype(jnp.int32)


def write_pages(pages: jax.Array, page: jax.Array, offset: jax.Array, new: jax.Array) -> jax.Array:
    """One layer's pages [K, N, ps, Dh]; page, offset [B, T] (``page_coordinates``); new [B, T, K, Dh] -> pages
    with ``new[b, t]`` stored at (:, page[b, t], offset[b, t]); out-of-range pages are dropped."""
    heads = jnp.arange(pages.shape[0], dtype=jnp.int32)
    return pages.at[heads[None, None, :], page[..., None], offset[..., None]].set(new.astype(pages.dtype),
                                                                                  mode="drop")


def copy_pages(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Copy page src[i] into page dst[i] in every layer and head (src, dst: [n] int32; a dst out of range is
    dropped, so callers can pad to a fixed n). The copy on write of a shared prompt's partial last page."""
    def copy(pages: jax.Array) -> jax.Array:
        return pages.at[:, dst].set(pages[:, jnp.clip(src, 0, pages.shape[1] - 1)], mode="drop")

    return PagedKVCache(k=tuple(copy(x) for x in cache.k), v=tuple(copy(x) for x in cache.v))


def gather_rows(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """One layer's pages [K, N, ps, Dh], page_table [B, P] -> [B, P * ps, K, Dh]: each row's positions in order
    (missing pages read page 0; attention masks those positions)."""
    kv, _, ps, dh = pages.shape
    b, p = page_table.shape
    rows = pages[:, jnp.maximum(page_table, 0)]  # [K, B, P, ps, Dh]
    return rows.transpose(1, 2, 3, 0, 4).reshape(b, p * ps, kv, dh)


def gather_attention(q: jax.Array, cache: PagedKVCache, layer: int, page_table: jax.Array,
                     positions: jax.Array, window: int | None = None, softcap: float | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention over a paged cache, by gathering each row's pages.

    q: [B, T, H, Dh] (RoPE applied); cache already holding this call's keys / values; page_table [B, P];
    positions [B, T]. Query (b, t) attends positions 0..positions[b, t] of row b (none when negative:
    zeros; with a sliding window only those above positions[b, t] - window, and a decode call gathers only the
    pages that window reaches; softcap: the scaled scores' `layers.soft_cap`; sinks: [H] each query head's sink
    logit, `attention_sinks`, or None). Returns [B, T, H, Dh] in q's dtype, with a float32 softmax."""
    b, t, h, dh = q.shape
    ps, per_row = cache.page_size, page_table.shape[1]
    if window is not None and t == 1:  # decode in a sliding layer: only the pages its window reaches
        span = min(per_row, (window_span(window) + ps - 2) // ps + 1)
        if span < per_row:
            first = jnp.clip((positions[:, 0] - window + 1) // ps, 0, per_row - span)  # [B]
            table = jnp.take_along_axis(page_table, first[:, None] + jnp.arange(span)[None, :], axis=1)
            return gather_attention(q, cache, layer, table, positions - first[:, None] * ps, window, softcap, sinks)
    k, v = gather_rows(cache.k[layer], page_table), gather_rows(cache.v[layer], page_table)
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = soft_cap(scores * np.float32(1.0 / math.sqrt(dh)), softcap)
    index = jnp.arange(k.shape[1])[None, None, :]
    visible = index <= positions[:, :, None]  # [B, T, S]
    if window is not None:
        visible = visible & (index > positions[:, :, None] - window)
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    probs = jnp.where(visible[:, None, None], sink_softmax(scores, sinks), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, dh).astype(q.dtype)


def kernel_attention(q: jax.Array, cache: PagedKVCache, layer: int, page_table: jax.Array, positions: jax.Array,
                     *, interpret: bool = False, platform: str | None = None,
                     softcap: float | None = None, mesh: Any = None, sinks: jax.Array | None = None,
                     tiling: tuple[int, int] | None = None) -> jax.Array:
    """``gather_attention`` for one query per row through a Pallas paged-attention kernel.

    q: [B, 1, H, Dh]; positions [B, 1]. Pages are read in place (no gathered copy). platform (default: JAX's
    default backend) picks the kernel: "tpu" the Mosaic kernel (head_dim a multiple of 128; blocks of up to
    512 positions), anything else the GPU kernel, which splits each row's pages into up to 16 partitions
    combined by an online softmax. interpret=True runs the chosen kernel on any backend (the CPU tests).
    softcap: both kernels' attn_logits_soft_cap (Gemma 2). mesh: the rollout mesh; when its "tensor" axis divides
    the kv heads (the pages split over it), the kernel runs in a shard_map on each device's heads (a Pallas kernel
    is a custom call XLA cannot partition: it would gather every head's pages to every device). sinks: [H] sink
    logits (`attention_sinks`), which neither kernel takes: with them the call is ``gather_attention``'s.
    tiling: the GPU kernels' (splits, pages per block), default ``gpu_tiling``'s (``sampler.paged_choice`` times
    others); the table is padded to a multiple of their product."""
    b, t, h, dh = q.shape
    if t != 1:
        raise ValueError(f"kernel_attention takes one query per row (decode), got {t}; use gather_attention.")
    if sinks is not None:
        return gather_attention(q, cache, layer, page_table, positions, softcap=softcap, sinks=sinks)
    platform = jax.default_backend() if platform is None else platform
    per_row = page_table.shape[1]
    lengths = jnp.clip(positions[:, 0] + 1, 0, per_row * cache.page_size).astype(jnp.int32)
    scaled = (q[:, 0].astype(jnp.float32) * np.float32(1.0 / math.sqrt(dh))).astype(q.dtype)
    table = jnp.maximum(page_table, 0)

    def run(scaled, k_pages, v_pages, table, lengths):
        if platform == "tpu":
            return _tpu_kernel(scaled, k_pages, v_pages, lengths, table, interpret, softcap)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        pieced = bool(dh & (dh - 1))  # not a power of two: in power-of-two pieces (latent attention's 576)
        reach = GPU_BLOCK_POSITIONS  # the pieced kernel's block: its widest tile within TILE_ELEMENTS
        if pieced:
            reach = max(1, min(reach, TILE_ELEMENTS // max(dh, v_pages.shape[-1])))
        width, splits, block = gpu_tiling(table.shape[0], k_pages.shape[0], per_row, cache.page_size, reach)
        if tiling is not None:
            splits, block = tiling
            width = -(-per_row // (splits * block)) * splits * block
        if width > per_row:  # padding columns: page 0, past every row's length, so the kernel never reads them
            table = jnp.pad(table, ((0, 0), (0, width - per_row)))
        if pieced:
            return pieced_paged_attention(scaled, k_pages, v_pages, table, lengths, softcap=softcap, splits=splits,
                                          pages_per_block=block, interpret=interpret)
        return paged_attention(scaled, k_pages, v_pages, table, lengths, attn_logits_soft_cap=softcap,
                               k_splits=splits, pages_per_compute_block=block, interpret=interpret)

    tensor = int(mesh.shape.get("tensor", 1)) if mesh is not None else 1
    if tensor > 1 and cache.k[layer].shape[0] % tensor == 0:
        heads, pages, whole = P(None, "tensor", None), P("tensor", None, None, None), P()
        run = jax.shard_map(run, mesh=mesh, in_specs=(heads, pages, pages, whole, whole), out_specs=heads,
                            check_vma=False)
    out = run(scaled, cache.k[layer], cache.v[layer], table, lengths)
    out = jnp.where((lengths > 0)[:, None, None], out.astype(jnp.float32), 0.0)
    return out[:, None].astype(q.dtype)


GPU_BLOCK_POSITIONS = 128  # positions a block of JAX's GPU kernel reads at once (its own default: 8 pages of 16)
GPU_PROGRAMS = 1024  # rows x kv heads x splits its grid aims at: several programs for each of an H100's 132 SMs


def gpu_tiling(rows: int, kv_heads: int, per_row: int, page_size: int,
               reach: int = GPU_BLOCK_POSITIONS) -> tuple[int, int, int]:
    """(page-table width, splits, pages per block) for JAX's GPU paged kernel over rows of ``per_row`` pages.

    Blocks of up to ``reach`` positions (a power-of-two count of pages, at least one); each row's pages split
    into as many parts as make rows x kv_heads x splits reach GPU_PROGRAMS (a power of two, at most 16 and at most
    the row's blocks); the table is padded up to a multiple of splits x block. The kernel wants the width divisible
    so, and stops at each row's length, so padding costs nothing; taking only divisors of the width instead gave
    one-page blocks at the sampler's usual widths (1,152 positions: 72 pages, 8 splits of 9; the
    paged engine's table, padded to 80: 16 splits of 5), 16 positions a load."""
    block = max(1, min(per_row, reach // page_size))
    block = 1 << (block.bit_length() - 1)
    blocks = -(-per_row // block)
    splits = 1
    while splits < 16 and rows * kv_heads * splits < GPU_PROGRAMS and splits * 2 <= blocks:
        splits *= 2
    unit = splits * block
    return -(-per_row // unit) * unit, splits, block


def _tpu_kernel(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array, table: jax.Array,
                interpret: bool, softcap: float | None = None) -> jax.Array:
    """The TPU kernel on q [B, H, Dh] (already scaled): blocks of the largest power-of-two count of pages
    dividing the row's pages and holding at most 512 positions."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    dh, page_size = q.shape[-1], k_pages.shape[2]
    if dh % 128:
        raise ValueError(f"the TPU paged-attention kernel needs head_dim a multiple of 128, got {dh}; use the "
                         "gather path (PagedEngine(attention='gather'), the default on TPUs for such models).")
    block = power_of_two_divisor(table.shape[1], max(1, 512 // page_size))
    call = lambda: paged_attention(q, k_pages, v_pages, lengths, table,  # noqa: E731
                                   pages_per_compute_block=block, attn_logits_soft_cap=softcap)
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            return call()
    return call()


def default_path(head_dim: int | None = None, platform: str | None = None) -> PagedPath:
    """"kernel" where a Pallas kernel reads pages in place: GPUs when head_dim (if given) is a power of two (JAX's
    kernel), TPUs when it is a multiple of 128; "gather" elsewhere (CPU). Other widths that are multiples of 16
    (latent attention's 576) take `paged_pieces`' kernel when "kernel" is asked for, or where "auto"
    (`sampler.paged_choice`) timed it faster on the GPU; untimed, it is not the default until it has run on a GPU
    (`benchmarks/paged_pieces.py`)."""
    platform = jax.default_backend() if platform is None else platform
    if platform == "gpu" and (head_dim is None or head_dim & (head_dim - 1) == 0):
        return "kernel"
    if platform == "tpu" and (head_dim is None or head_dim % 128 == 0):
        return "kernel"
    return "gather"


def paged_hidden(model: Any, tokens: jax.Array, positions: jax.Array, cache: PagedKVCache, page_table: jax.Array,
                 path: PagedPath | None = None, interpret: bool = False, platform: str | None = None,
                 rings: KVCache | None = None, mesh: Any = None, record_routes: bool = False,
                 tiling: tuple[int, int] | None = None) -> tuple:
    """The cache branch of ``Transformer.hidden`` over a paged cache.

    model: a Transformer; tokens, positions: [B, T] int32; page_table: [B, P] int32 (-1 = no page). Each
    token's key / value is written at its position (through the page table; writes to missing pages are
    dropped), then attention reads positions 0..p of the row (a sliding layer: its window). Returns
    (final-norm hidden states [B, T, D] in the compute dtype, the new cache). path: "gather" or "kernel" (T
    must be 1), default ``default_path(head_dim)``; platform: whose kernel "kernel" runs
    (``kernel_attention``). JAX's paged kernels take no window and no sinks: sliding layers gather their window's
    pages on either path, and so does a model with attention sinks. rings (`init_rings`, one row per row of the
    batch; T must be 1): the layers with ring rows there write and read them (`cache_attention.ring_attention`)
    instead of pages, and the new rings are returned third; a Gated DeltaNet layer keeps its window and state there. mesh: the rollout mesh the kernel path splits heads
    over (`kernel_attention`). record_routes: a mixture-of-experts model's experts of each token, [B, T, L_moe, k]
    int32, come last (`Transformer.hidden`). tiling: the GPU kernel's (splits, pages per block) (`kernel_attention`)."""
    cfg = model.cfg
    b, t = tokens.shape
    if positions.shape != (b, t) or page_table.shape[0] != b:
        raise ValueError(f"paged_hidden got tokens {tokens.shape}, positions {positions.shape} and page_table "
                         f"{page_table.shape}; expected [B, T], [B, T] and [B, P].")
    path = default_path(cache_layout(cfg)[1]) if path is None else path
    if path == "kernel" and t != 1:
        path = "gather"  # prefill-style calls read through the gathered view
    page, offset = page_coordinates(page_table, positions, cache.page_size, cache.num_pages)
    tables = rope_tables(cfg, positions)
    x = model.embed(tokens)
    k_all, v_all = list(cache.k), list(cache.v)
    picks: list[jax.Array] | None = [] if record_routes else None  # each expert layer's [B, T, k]

    ring_k, ring_v = (list(rings.k), list(rings.v)) if rings is not None else ([], [])
    if rings is not None and t != 1:
        raise ValueError(f"ring rows take one token per row (decode), got {t}.")
    for i, layer in enumerate(model.layers):
        window = cfg.layer_window(i)
        stateful = cfg.layer_is_linear(i) or cfg.layer_is_hybrid(i)
        if stateful and rings is None:
            raise ValueError(f"layer {i} keeps a state (a stateful mixer): paged_hidden needs rings holding it "
                             "(init_rings with its state entry, `ModelConfig.state_entry`, among them).")
        if cfg.layer_is_linear(i):  # Gated DeltaNet: its window and state are a row's, beside the pages, in rings
            x = state_layer(layer, x, tables[cfg.layer_rope(i)], ring_k, ring_v, i, positions, picks)
            continue
        if rings is not None and ring_k[i].shape[1]:
            r = ring_k[i].shape[1]
            at, rows = jnp.where(positions >= 0, positions % r, r), jnp.arange(b)[:, None]

            def attend(q, k, v, sinks=None, i=i, window=window, at=at, rows=rows):
                ring_k[i] = ring_k[i].at[rows, at].set(k.astype(ring_k[i].dtype), mode="drop")
                ring_v[i] = ring_v[i].at[rows, at].set(v.astype(ring_v[i].dtype), mode="drop")
                return ring_attention(q, ring_k[i], cached_values(ring_k[i], ring_v[i]), positions, window,
                                      cfg.attn_logit_softcap, sinks)

            x = cached_layer(layer, x, tables[cfg.layer_rope(i)], attend, picks) if not stateful else \
                state_layer(layer, x, tables[cfg.layer_rope(i)], ring_k, ring_v, cfg.state_entry(i), positions, picks,
                            attend)
            continue

        def attend(q, k, v, sinks=None, i=i, window=window):
            k_all[i], v_all[i] = write_pages(k_all[i], page, offset, k), write_pages(v_all[i], page, offset, v)
            current = PagedKVCache(k=tuple(k_all), v=tuple(cached_values(k, v) for k, v in zip(k_all, v_all)))
            if path == "kernel" and window is None:
                return kernel_attention(q, current, i, page_table, positions, interpret=interpret, platform=platform,
                                        softcap=cfg.attn_logit_softcap, mesh=mesh, sinks=sinks, tiling=tiling)
            return gather_attention(q, current, i, page_table, positions, window, cfg.attn_logit_softcap, sinks)

        x = cached_layer(layer, x, tables[cfg.layer_rope(i)], attend, picks) if not stateful else \
            state_layer(layer, x, tables[cfg.layer_rope(i)], ring_k, ring_v, cfg.state_entry(i), positions, picks, attend)
    out = model.last_norm(x), PagedKVCache(k=tuple(k_all), v=tuple(v_all))
    out = out if rings is None else (*out, KVCache(k=tuple(ring_k), v=tuple(ring_v)))
    return (*out, stacked_routes(picks, b, t)) if record_routes else out
