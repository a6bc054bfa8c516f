"""Grouped matmul of expert-aligned row blocks: a Pallas kernel for the mixture-of-experts "pallas" path.

The rows of x come in blocks of `block` rows, and block b belongs to one expert, owner[b] (non-decreasing: the
blocks of an expert are contiguous, as `expert_paths.block_layout` lays them out). The product is

    y[b * block + i, :] = x[b * block + i, :] @ w[owner[b]]

in one kernel launch: no loop on the host or in XLA, no dense expansion to every expert, no gather of a weight
copy per block. This is the layout the "blocked" path scans over one block at a time; on a GPU each scan step is a
few small launches and a loop iteration, which the kernel replaces with one grid.

Kernels (written for the Pallas Triton lowering on NVIDIA GPUs; `interpret=True` runs the same code on any
backend, which is how CPU tests execute them):

  * gmm: grid (blocks, N / bn); a program reads its block's expert from `owner`, loops over K in tiles of bk and
    accumulates [block, bn] in float32. With `transpose_rhs` it multiplies by w[owner[b]]^T instead (w [E, N, K]):
    the input gradient dx = dy @ w^T of the backward.
  * tgmm (the weight gradient): grid (experts, K / bk, N / bn); a program loops over its expert's blocks, from
    start[e] to end[e] (searched in `owner`), and accumulates x_b^T @ dy_b in float32. An expert without rows gets
    zeros.

`grouped_matmul` is differentiable in x and w (a custom VJP of the two kernels above). Every tile size is a
power of two of at least 16 (Triton's smallest dot); a dimension with no such divisor is refused, and
`supports` tells the caller beforehand.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

MAX_TILE_N = 128
MAX_TILE_K = 64


def tile(size: int, largest: int) -> int:
    """The largest power of two <= `largest` that divides `size`, or 0 when it would be below 16."""
    t = largest
    while t >= 16:
        if size % t == 0:
            return t
        t //= 2
    return 0


def supports(block: int, k: int, n: int) -> bool:
    """Whether the kernels take blocks of `block` rows and weights of [K, N] (each tile a power of two >= 16)."""
    return block >= 16 and not block & (block - 1) and bool(tile(k, MAX_TILE_K)) and bool(tile(n, MAX_TILE_N))


def _dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _gmm_kernel(owner_ref, x_ref, w_ref, o_ref, *, bk: int, bn: int, transpose_rhs: bool):
    j = pl.program_id(1)
    e = owner_ref[0]  # this block's expert: a one-element block of owner (as JAX's GPU paged kernel reads lengths)
    k = x_ref.shape[1]

    def body(kk, acc):
        xk = x_ref[:, pl.ds(kk * bk, bk)]
        if transpose_rhs:
            return acc + _dot_nt(xk, w_ref[e, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)])
        return acc + _dot(xk, w_ref[e, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)])

    @pl.when(e < w_ref.shape[0])
    def _():
        acc = lax.fori_loop(0, k // bk, body, jnp.zeros((x_ref.shape[0], bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(e >= w_ref.shape[0])  # a block of no expert here (expert parallelism's other devices' pairs): zeros
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _tgmm_kernel(start_ref, end_ref, x_ref, dy_ref, dw_ref, *, block: int, bk: int, bn: int):
    i, j = pl.program_id(1), pl.program_id(2)

    def body(b, acc):
        xb = x_ref[pl.ds(b * block, block), pl.ds(i * bk, bk)]
        dyb = dy_ref[pl.ds(b * block, block), pl.ds(j * bn, bn)]
        return acc + _dot_tn(xb, dyb)

    acc = lax.fori_loop(start_ref[0], end_ref[0], body, jnp.zeros((bk, bn), jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _params(interpret: bool, block: int):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4 if block <= 64 else 8, num_stages=3)


def _gmm(x, w, owner, *, block: int, transpose_rhs: bool, out_dtype, interpret: bool):
    rows, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    bk, bn = tile(k, MAX_TILE_K), tile(n, MAX_TILE_N)
    nb = rows // block
    return pl.pallas_call(
        functools.partial(_gmm_kernel, bk=bk, bn=bn, transpose_rhs=transpose_rhs),
        grid=(nb, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda b, j: (b,)),
                  pl.BlockSpec((block, k), lambda b, j: (b, 0)),
                  pl.BlockSpec(w.shape, lambda b, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((block, bn), lambda b, j: (b, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype),
        compiler_params=_params(interpret, block),
        interpret=interpret,
        name="expert_gmm_t" if transpose_rhs else "expert_gmm",
    )(owner, x, w)


def _tgmm(x, dy, owner, experts: int, *, block: int, out_dtype, interpret: bool):
    rows, k = x.shape
    n = dy.shape[1]
    bk, bn = tile(k, MAX_TILE_K), tile(n, MAX_TILE_N)
    ids = jnp.arange(experts, dtype=owner.dtype)
    start = jnp.sum(owner[None, :] < ids[:, None], axis=1, dtype=jnp.int32)  # owner is sorted: its run of blocks
    end = jnp.sum(owner[None, :] <= ids[:, None], axis=1, dtype=jnp.int32)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, block=block, bk=bk, bn=bn),
        grid=(experts, k // bk, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda e, i, j: (e,)),
                  pl.BlockSpec((1,), lambda e, i, j: (e,)),
                  pl.BlockSpec(x.shape, lambda e, i, j: (0, 0)),
                  pl.BlockSpec(dy.shape, lambda e, i, j: (0, 0))],
        out_specs=pl.BlockSpec((None, bk, bn), lambda e, i, j: (e, i, j)),
        out_shape=jax.ShapeDtypeStruct((experts, k, n), out_dtype),
        compiler_params=_params(interpret, block),
        interpret=interpret,
        name="expert_tgmm",
    )(start, end, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(x, w, owner, block, out_dtype, interpret):
    return _gmm(x, w, owner, block=block, transpose_rhs=False, out_dtype=out_dtype, interpret=interpret)


def _grouped_fwd(x, w, owner, block, out_dtype, interpret):
    return _grouped(x, w, owner, block, out_dtype, interpret), (x, w, owner)


def _grouped_bwd(block, out_dtype, interpret, res, dy):
    x, w, owner = res
    dy = dy.astype(x.dtype)  # bf16 operands in a bf16 model, as the forward's (accumulation stays float32)
    dx = _gmm(dy, w, owner, block=block, transpose_rhs=True, out_dtype=x.dtype, interpret=interpret)
    dw = _tgmm(x, dy, owner, w.shape[0], block=block, out_dtype=w.dtype, interpret=interpret)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, owner: jax.Array, *, block: int, out_dtype=None,
                   interpret: bool | None = None) -> jax.Array:
    """y [R, N] with y[b * block + i] = x[b * block + i] @ w[owner[b]], differentiable in x and w.

    x: [R, K], R a multiple of `block`; w: [E, K, N]; owner: [R / block] int, non-decreasing, in [0, E] (the
    weight gradient sums each expert over its contiguous run of blocks); blocks of owner E belong to no expert of w:
    their rows are zeros and take no gradient (expert parallelism's pairs for other devices' experts). out_dtype: default x's; products
    accumulate in float32. interpret: run the Pallas interpreter (default: on any backend but GPU)."""
    rows, k = x.shape
    if w.ndim != 3 or w.shape[1] != k:
        raise ValueError(f"grouped_matmul: x {x.shape} and w {w.shape}; expected x [R, K] and w [E, K, N].")
    if rows % block or owner.shape != (rows // block,):
        raise ValueError(f"grouped_matmul: {rows} rows in blocks of {block} need owner of shape ({rows // block},), "
                         f"got {owner.shape}.")
    if not supports(block, k, w.shape[2]):
        raise ValueError(f"grouped_matmul: blocks of {block} rows and weights [{k}, {w.shape[2]}] do not tile: the "
                         "block must be a power of two >= 16 and K, N multiples of 16 (`supports` checks).")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _grouped(x, w, owner.astype(jnp.int32), int(block), jnp.dtype(out_dtype or x.dtype), bool(interpret))
