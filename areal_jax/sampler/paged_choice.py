"""The paged cache's decode attention, chosen by measuring it: ``PagedEngine(attention="auto")``,
``rollout.paged_attention=auto``.

Over pages a decode step's attention is either gathered (`paged_attention.gather_attention`: every page of a row's
table copied into a dense view that XLA attends over) or read in place by a Pallas kernel (`kernel_attention`: JAX's
GPU paged-attention kernel for power-of-two head widths, `paged_pieces`' kernel for other multiples of 16, such as
latent attention's 576 or Phi-3's 96), each row up to its length, in blocks of pages over splits of the row. The
kernel's speed hangs on that tiling (with one-page blocks an H100's paged sampler ran at 0.71x the dense one), and the
pieced kernel has not run on a GPU. "auto" settles both as the dense cache's choice does (`sampler.decode_choice`): on
a GPU it times one layer's attention at the engine's per-device shapes, the gather path and the kernel at
`gpu_tiling`'s tiling and a few others, with rows at lengths spread evenly over their pages, and takes the kernel at
its fastest tiling only where it compiled, matched the gather path's output and was at least `decode_choice.MARGIN`
faster. Elsewhere "auto" is `paged_attention.default_path`, untimed: the gather path on CPUs, JAX's Mosaic kernel on
TPUs (whose blocks are its own). So it is where no kernel applies (attention sinks, every layer sliding or linear,
other head widths) and on a mesh that spans processes (each would time on its own).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import paged_pieces
from areal_jax.models.mla import cache_layout
from areal_jax.models.paged_attention import (
    GPU_BLOCK_POSITIONS,
    PagedKVCache,
    default_path,
    gather_attention,
    gpu_tiling,
    kernel_attention,
)
from areal_jax.models.transformer import cache_dtype
from areal_jax.sampler.decode_choice import DecodeChoice, Timer, first_line, race, settle

PATHS = ("auto", "gather", "kernel")


def block_reach(width: int) -> int:
    """Positions a kernel block reads at once by default: JAX's kernel GPU_BLOCK_POSITIONS; the pieced kernel's
    blocks keep their widest tile within `paged_pieces.TILE_ELEMENTS` (as `kernel_attention` tiles them)."""
    if width & (width - 1) == 0:
        return GPU_BLOCK_POSITIONS
    return max(1, min(GPU_BLOCK_POSITIONS, paged_pieces.TILE_ELEMENTS // width))


def candidate_tilings(rows: int, kv_heads: int, per_row: int, page_size: int, width: int) -> list[tuple[int, int]]:
    """(splits, pages per block) tilings to time: `gpu_tiling`'s first, then twice the splits, twice the block, half
    the block and twice the splits at half the block. A block holds at least one page and at most twice the
    default reach of positions (the pieced kernel: its reach, past which a tile outgrows shared memory); each split
    holds at least one block."""
    reach = block_reach(width)
    _, splits, block = gpu_tiling(rows, kv_heads, per_row, page_size, reach)
    most = max(1, (reach if width & (width - 1) else 2 * reach) // page_size)
    out = [(splits, block)]
    for s, b in ((2 * splits, block), (splits, 2 * block), (splits, block // 2), (2 * splits, block // 2)):
        if 1 <= b <= most and s <= -(-per_row // b) and (s, b) not in out:
            out.append((s, b))
    return out


def kernel_takes(width: int) -> bool:
    """Whether a GPU paged kernel reads heads this wide: JAX's (powers of two) or the pieced one."""
    return width & (width - 1) == 0 or paged_pieces.supports(width)


def choose(config: Any, rows: int, per_row: int, page_size: int, mesh: jax.sharding.Mesh | None = None, *,
           backend: str | None = None, timer: Timer | None = None, interpret: bool | None = None) -> DecodeChoice:
    """The decode attention "auto" means for a PagedEngine of `rows` slots whose tables hold `per_row` pages of
    `page_size` positions, for this model config on `mesh` (see the module's docstring). backend, timer and
    interpret: for tests (`decode_choice.choose`'s)."""
    backend = jax.default_backend() if backend is None else backend
    kv, dh, dv = cache_layout(config)
    width = max(dh, dv)

    def untimed(path: str, why: str) -> DecodeChoice:
        return DecodeChoice(path, reason=why, cache="paged")

    if backend != "gpu":
        fallback = default_path(dh, backend)
        what = "JAX's Mosaic kernel" if fallback == "kernel" else "the gather path"
        return untimed(fallback, f"{what}, untimed: auto times the paths on GPUs (this backend is {backend})")
    if getattr(config, "attention_sinks", False):
        return untimed("gather", "the paged kernels take no attention sinks")
    if not kernel_takes(width):
        return untimed("gather", f"no paged kernel takes heads {width} wide")
    linear = config.layer_is_linear if getattr(config, "recurrent", False) else (lambda i: False)
    if all(linear(i) or config.layer_window(i) is not None for i in range(config.num_layers)):
        return untimed("gather", "no attention layer reads its pages whole (sliding layers gather their window's "
                                 "pages, linear attention keeps a state)")
    if mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1:
        return untimed(default_path(dh, backend), "the sampler's mesh spans processes, whose timings could disagree; "
                                                  "set rollout.paged_attention to gather or kernel to choose")
    heads = config.num_heads
    tensor = int(mesh.shape.get("tensor", 1)) if mesh is not None else 1
    if tensor > 1 and kv % tensor == 0 and heads % tensor == 0:  # the kernel runs on each device's heads
        kv, heads = kv // tensor, heads // tensor
    return choose_shape(rows, per_row, page_size, heads, kv, dh, dv, cache_dtype(config, backend),
                        softcap=config.attn_logit_softcap, device=mesh.devices.flat[0] if mesh is not None else None,
                        timer=timer, interpret=interpret)


def choose_shape(rows: int, per_row: int, page_size: int, heads: int, kv_heads: int, head_dim: int, value_dim: int,
                 dtype: Any, *, softcap: float | None = None, device: Any = None, timer: Timer | None = None,
                 interpret: bool | None = None) -> DecodeChoice:
    """`choose` for one device's attention: `rows` queries of `heads` heads over tables of `per_row` pages of
    [page_size, kv_heads, head_dim] keys and value_dim-wide values (0: the keys serve as values, as latent
    attention's do), timed on `device` (default JAX's first). Choices made with the real clock are kept for the
    process."""
    device = jax.devices()[0] if device is None else device
    dtype = jnp.dtype(dtype)
    key = ("paged", device.device_kind, rows, per_row, page_size, heads, kv_heads, head_dim, value_dim, dtype.name,
           softcap)
    pages = rows * per_row * page_size * kv_heads * (head_dim + value_dim) * dtype.itemsize
    return settle(key, 2 * pages, device, timer, "gather", lambda clock: _timed(  # the pages and the gathered copy
        rows, per_row, page_size, heads, kv_heads, head_dim, value_dim, dtype, softcap, device, clock, interpret),
        cache="paged")


def _timed(rows: int, per_row: int, page_size: int, heads: int, kv: int, dh: int, dv: int, dtype: Any,
           softcap: float | None, device: Any, timer: Timer, interpret: bool | None) -> DecodeChoice:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, per_row * page_size + 1, size=rows).astype(np.int32)  # half the pages live
    table = rng.permutation(rows * per_row).reshape(rows, per_row).astype(np.int32)  # a row's pages anywhere
    try:
        with jax.default_device(device):
            keys = jax.random.split(jax.random.key(0), 3)
            k_pages = jax.random.normal(keys[1], (kv, rows * per_row, page_size, dh), dtype)
            v_pages = jax.random.normal(keys[2], (kv, rows * per_row, page_size, dv), dtype) if dv else k_pages
            inputs = (jax.random.normal(keys[0], (rows, heads, dh), dtype), k_pages, v_pages, jnp.asarray(table),
                      jnp.asarray(lengths))
    except Exception as err:  # noqa: BLE001 - out of memory, say: the engine gathers
        return DecodeChoice("gather", reason=f"timing the gather path failed ({first_line(err)})", cache="paged")
    kernels = {tiling: _kernel(softcap, tiling, interpret)
               for tiling in candidate_tilings(rows, kv, per_row, page_size, max(dh, dv))}
    return race(inputs, ("gather", "the gather path", _gather(softcap)), kernels, dtype, timer, cache="paged")


def _gather(softcap: float | None) -> Callable[..., jax.Array]:
    """The gather path's attention of q [B, H, Dh] over one layer's pages, rows up to lengths [B]."""
    def attend(q, k_pages, v_pages, table, lengths):
        cache = PagedKVCache(k=(k_pages,), v=(v_pages,))
        return gather_attention(q[:, None], cache, 0, table, (lengths - 1)[:, None], softcap=softcap)[:, 0]

    return attend


def _kernel(softcap: float | None, tiling: tuple[int, int], interpret: bool | None) -> Callable[..., jax.Array]:
    def attend(q, k_pages, v_pages, table, lengths):
        cache = PagedKVCache(k=(k_pages,), v=(v_pages,))
        return kernel_attention(q[:, None], cache, 0, table, (lengths - 1)[:, None], interpret=bool(interpret),
                                platform="gpu", softcap=softcap, tiling=tiling)[:, 0]

    return attend


def resolve(attention: str | None, config: Any, rows: int, per_row: int, page_size: int,
            mesh: jax.sharding.Mesh | None = None) -> DecodeChoice:
    """A PagedEngine's attention setting ("auto" or None, "gather", "kernel") -> its choice."""
    attention = "auto" if attention is None else attention
    if attention not in PATHS:
        raise ValueError(f"paged attention must be one of {', '.join(PATHS)}, got {attention!r}.")
    if attention != "auto":
        return DecodeChoice(attention, reason="as configured", cache="paged")
    if config is None:
        return DecodeChoice(default_path(None), reason="no model config to time with", cache="paged")
    return choose(config, rows, per_row, page_size, mesh)
