"""The four ways `models.moe.MoE` runs its experts (`ModelConfig.moe_impl`), equal up to float summation order. Each
takes a device's rows x [N, D], the expert weights gate, up [E, D, F] and down [E, F, D] (arrays, or `Factored` with
LoRA adapters), the routing weights and picks [N, k], the activation (`glu`) and the gate / up biases, and returns
the tokens' weighted outputs [N, D]:

- ``blocked`` (the default on CPUs, and on GPUs above `DENSE_DECODE_TOKENS` tokens a device): the (token, expert)
  pairs sorted by expert into blocks of `expert_block` rows, each expert's group padded to whole blocks (at most
  num_experts * (block - 1) padding rows: a static bound), and a `lax.scan` over the blocks multiplies each by its
  expert's weights: the top-k work plus the padding, static shapes, no dense expansion (docs/models.md's figures).
- ``ragged``: the sorted pairs through `jax.lax.ragged_dot` (TPU's choice: a grouped matmul there; XLA:CPU and
  XLA:GPU may expand it to every expert).
- ``pallas``: the blocked layout through one grouped-matmul Pallas kernel (`models.grouped_matmul`), no scan; for
  GPUs (the Pallas interpreter elsewhere: tests only). Widths that do not tile by 16 fall back to the scan.
- ``dense``: every expert on every token, outputs weighted by the routing weights (zero off the top k):
  num_experts / num_experts_per_tok times the matmul work in plain dots; the reference, and GPUs' default at a
  decode step's few hundred tokens (`resolve_moe_impl`).

Under expert parallelism (`models.expert_parallel`, shards > 1) a pick of id E marks another device's expert: every
path skips it or gives it a zero output.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from areal_jax.models.factored import Factored, grouped
from areal_jax.models.grouped_matmul import grouped_matmul, supports

DENSE_DECODE_TOKENS = 256


def resolve_moe_impl(choice: str, backend: str | None = None, tokens: int | None = None,
                     expert_parallel: bool = False) -> str:
    """The expert computation `choice` stands for on `backend` (default JAX's) for `tokens` tokens a device: "auto"
    is ragged on TPU; on GPUs pallas under expert parallelism, else dense for at most DENSE_DECODE_TOKENS tokens (a
    decode step of that many sequences), else blocked; blocked on CPUs.

    Why dense at decode on GPUs: with a few hundred tokens x k picks every expert is hit, so any path reads every
    expert's weights once, and the dense product over all experts stays bound by that read while its FLOPs per
    weight byte (one per token in bf16) are under the GPU's compute-to-bandwidth ratio (H200: 726 TFLOP/s over 4.8
    TB/s, about 150; H100 about 300): 256 tokens cost at most about 1.7x the weights' read there. The blocked scan
    instead runs about E * (1 + tokens * k / E / block) steps of three small products a layer, one after another
    (about 250 at Qwen3-30B-A3B's shape), each a few kernel launches. CPUs compute-bound from about 20 tokens
    (float32), so they keep the blocked path (`benchmarks/moe.py --forward-only`)."""
    if choice != "auto":
        return choice
    backend = jax.default_backend() if backend is None else backend
    if backend == "tpu":
        return "ragged"
    if backend == "gpu" and expert_parallel:  # the kernel skips other devices' blocks on the device; the scan's
        return "pallas"  # lax.cond would copy each block's predicate to the host (docs/scale.md)
    if backend == "gpu" and tokens is not None and tokens <= DENSE_DECODE_TOKENS:
        return "dense"
    return "blocked"


MAX_EXPERT_BLOCK = 128  # benchmarks/moe.py --max-blocks times others (a GPU may want fewer, larger blocks)


def expert_block(pairs: int, experts: int) -> int:
    """Rows per block of the blocked path: the power of two nearest the mean group size pairs / experts, within
    [8, MAX_EXPERT_BLOCK] (each expert's group then takes about one or two blocks, and the padding stays at most about
    the pairs themselves; 128 rows keep a block's matmul efficient on a CPU)."""
    mean = max(pairs / experts, 1.0)
    return int(min(MAX_EXPERT_BLOCK, max(8, 2 ** round(math.log2(mean)))))


def glu(limit: float | None = None, alpha: float = 1.702, gated: bool = True):
    """An expert's activation of its gate and up products: silu(g) * u (SwiGLU), or with a limit gpt-oss's
    (min(u, limit) clipped to +-limit + 1) * g' * sigmoid(alpha * g') with g' = min(g, limit); an ungated expert's
    (not `gated`: Nemotron-H's) relu(u)^2 of its up product alone (g None)."""
    if not gated:
        return lambda g, u: jnp.square(jax.nn.relu(u))
    if limit is None:
        return lambda g, u: jax.nn.silu(g) * u

    def clamped(g: jax.Array, u: jax.Array) -> jax.Array:
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
        return (u + 1) * (g * jax.nn.sigmoid(g * alpha))

    return clamped


def biased(z: jax.Array, bias: jax.Array | None, index: Any) -> jax.Array:
    """z plus bias[index] (the experts' rows of a gate or up bias [E, F]); z without a bias."""
    return z if bias is None else z + bias[index].astype(z.dtype)


def activated(z: jax.Array, gate: Any, up: Any, product, bias: tuple, index: Any, act) -> jax.Array:
    """act of rows z's gate and up products by their experts' weights (`grouped` through `product`), each plus its bias
    rows at `index`; an ungated expert (gate None) skips the gate's."""
    g = None if gate is None else biased(grouped(z, gate, product), bias[0], index)
    return act(g, biased(grouped(z, up, product), bias[1], index))


def dense_experts(x: jax.Array, gate: Any, up: Any, down: Any, weights: jax.Array, experts: jax.Array,
                   act=glu(), bias: tuple = (None, None), *, shards: int = 1) -> jax.Array:
    """Every expert on every token. x [N, D]; gate, up [E, D, F]; down [E, F, D] (arrays or `Factored`);
    weights, experts [N, k]; act: `glu`; bias: the gate and up biases [E, F] (or None each). Ids of E (expert
    parallelism's other devices' experts, weight 0) add nothing."""
    n, e = x.shape[0], up.shape[0]
    combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], experts].add(weights)

    def spread(z, w, out_dtype):  # [N, in] or [N, E, in] by [E, in, out] -> [N, E, out]
        eq = "nd,edf->nef" if z.ndim == 2 else "ned,edf->nef"
        return jnp.einsum(eq, z, w, preferred_element_type=out_dtype).astype(out_dtype or z.dtype)

    def gather(z, w, out_dtype):  # [N, E, in] by [E, in, out] -> [N, out], summed over the experts
        return jnp.einsum("nef,efd->nd", z, w, preferred_element_type=out_dtype).astype(out_dtype or z.dtype)

    every = slice(None)
    h = activated(x, gate, up, spread, bias, every, act)
    h = h * combine[:, :, None].astype(x.dtype)
    if isinstance(down, Factored):  # h's rank-r projection per expert, then the experts' sum through b
        delta = gather(spread(h, down.a, None), down.b, jnp.float32)
        return (gather(h, down.base, jnp.float32) + down.scale * delta).astype(x.dtype)
    return gather(h, down, jnp.float32).astype(x.dtype)


def ragged_experts(x: jax.Array, gate: Any, up: Any, down: Any, weights: jax.Array, experts: jax.Array,
                    act=glu(), bias: tuple = (None, None), *, shards: int = 1) -> jax.Array:
    """The (token, expert) pairs grouped by expert through `jax.lax.ragged_dot`; same arguments as the dense path
    (ids of E sort last, past every group: ragged_dot gives their rows zeros)."""
    n, k = experts.shape
    e = up.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]

    def mm(z, w, out_dtype):
        return jax.lax.ragged_dot(z, w, sizes, preferred_element_type=out_dtype).astype(out_dtype or z.dtype)

    owner = flat[order]
    h = activated(xs, gate, up, mm, bias, owner, act)
    y = grouped(h, down, mm, jnp.float32)
    y = y * weights.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(y, token, num_segments=n).astype(x.dtype)


def block_layout(experts: jax.Array, num_experts: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The expert-aligned blocks of the routed pairs. experts: [N, k] -> (row [N * k]: each pair's padded row,
    token [rows]: each padded row's token (N for padding), owner [rows / block]: each block's expert, non-decreasing).
    Each expert's pairs take a run of whole blocks in routing order; rows = N * k + num_experts * (block - 1) rounded up
    to a whole block (a static bound on the padding)."""
    n, k = experts.shape
    e = num_experts
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e)
    padded = (sizes + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    sorted_expert = flat[order]
    # the i-th sorted pair goes to its expert's first padded row plus its rank within the expert's group
    row_of_sorted = (padded_end - padded)[sorted_expert] + jnp.arange(n * k) - (jnp.cumsum(sizes) - sizes)[sorted_expert]
    row = jnp.zeros(n * k, jnp.int32).at[order].set(row_of_sorted.astype(jnp.int32), unique_indices=True)
    rows = -(-(n * k + e * (block - 1)) // block) * block
    token = jnp.full((rows,), n, jnp.int32).at[row].set(jnp.arange(n * k, dtype=jnp.int32) // k, unique_indices=True)
    # a block's expert: the group its first row lies in (blocks past the last group hold zeros; any expert serves)
    # (counted by comparison: jnp.searchsorted fails to trace inside shard_map on this JAX)
    starts = jnp.arange(rows // block) * block
    owner = jnp.minimum(jnp.sum(padded_end[None, :] <= starts[:, None], axis=1), e - 1)
    return row, token, owner.astype(jnp.int32)


def blocked_experts(x: jax.Array, gate: Any, up: Any, down: Any, weights: jax.Array, experts: jax.Array,
                     act=glu(), bias: tuple = (None, None), *, kernel: bool = False, shards: int = 1) -> jax.Array:
    """The sorted pairs in expert-aligned blocks (`block_layout`), one `lax.scan` step a block, or with `kernel` the
    grouped-matmul Pallas kernel over all blocks at once; same arguments as the dense path. Rows move by gathers
    (pair -> padded row, padded row -> token), never by float scatters. shards > 1 (expert parallelism): x holds the
    tokens of `shards` devices and an expert id of E marks another device's expert (`expert_parallel.local_pairs`):
    those pairs' blocks are skipped and their outputs are zeros."""
    n, k = experts.shape
    e = up.shape[0]
    block = expert_block(n * k // shards, e)
    if kernel:
        block = max(block, 16)
    row, token, owner = block_layout(experts, e + (shards > 1), block)
    rows = token.shape[0]
    xs = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[token]  # padding rows read a zero row
    if kernel:
        def mm(z, w, out_dtype):
            return grouped_matmul(z, w, owner, block=block, out_dtype=out_dtype)

        per_row = jnp.repeat(owner, block, total_repeat_length=rows)
        h = activated(xs, gate, up, mm, bias, per_row, act)
        ys = grouped(h, down, mm, jnp.float32)
    else:
        def body(_, inp):
            xb, j = inp

            def mm(z, w, out_dtype):
                return jnp.dot(z, w[j], preferred_element_type=out_dtype).astype(out_dtype or z.dtype)

            hb = activated(xb, gate, up, mm, bias, j, act)
            return None, grouped(hb, down, mm, jnp.float32)

        if shards > 1:  # most blocks hold other devices' pairs: compute only this device's experts'
            compute = body
            body = lambda c, inp: jax.lax.cond(  # noqa: E731
                inp[1] < e, compute, lambda c, inp: (None, jnp.zeros((block, x.shape[1]), jnp.float32)), c, inp)

        # Without the checkpoint, reverse mode keeps each step's slices gate[j], up[j], down[j] as residuals:
        # [blocks, D, F] a weight, many times the weights themselves. Saving only the products' outputs, the
        # backward slices the weights again (no FLOPs) and recomputes silu(g) * u.
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        _, ys = jax.lax.scan(body, None, (xs.reshape(rows // block, block, -1), owner))
    y = ys.reshape(rows, -1)[row].reshape(n, k, -1)  # each token's k outputs, in its routing order
    return jnp.einsum("nkd,nk->nd", y, weights).astype(x.dtype)


def pallas_experts(x: jax.Array, gate: Any, up: Any, down: Any, weights: jax.Array, experts: jax.Array,
                    act=glu(), bias: tuple = (None, None), *, shards: int = 1) -> jax.Array:
    """The blocked layout through the grouped-matmul kernel (`grouped_matmul`), where its tiles fit the widths
    (multiples of 16; with `Factored` weights, the rank too), else the scan."""
    d, f = up.shape[1], up.shape[2]
    fits = supports(16, d, f) and supports(16, f, d)
    if isinstance(up, Factored):
        r = up.a.shape[2]
        fits = fits and all(supports(16, *dims) for dims in ((d, r), (r, f), (f, r), (r, d)))
    return blocked_experts(x, gate, up, down, weights, experts, act, bias, kernel=fits, shards=shards)


PATHS = {"dense": dense_experts, "ragged": ragged_experts, "blocked": blocked_experts,
          "pallas": pallas_experts}
