"""Expert parallelism for `models.moe.MoE` under a mesh context: each device of the batch axis (fsdp) holds
num_experts / fsdp whole experts instead of a 1 / fsdp slice of every expert, and the tokens go to the experts rather
than the experts' weights to the tokens.

Dispatch is by all-gather, dropless and exact: inside the MoE layer's shard_map each device routes its own rows,
then gathers every device's rows with their routing (`gather_pairs`: [tokens of all shards, D] plus the [.., k]
weights and picks), runs its own experts on the (token, expert) pairs that picked them (`local_pairs` marks the
others with the sentinel id `count`, weight 0: the expert paths skip or zero them), and a reduce-scatter
(`scatter_outputs`) sums each token's partial outputs from every device back onto the device that owns the token.
The backward is the transpose: the outputs' cotangents all-gathered, the inputs' reduce-scattered.

What crosses devices per layer and micro-batch: the batch's activations [N, D] four times (gathered and reduce-scattered in
the forward, the same in the backward), each (fsdp - 1) / fsdp of them, where FSDP moves the experts' weights 3 E D F
three times (gathered for the forward and again for the backward, their gradients reduce-scattered). The tokens are
the cheaper below N = 2.25 E F tokens a micro-batch: about 221k at Qwen3-30B-A3B's shape (E = 128, F = 768), 1.2M at
DeepSeek-V3's (256 x 2048), whose 22.5 GB of bf16 experts a layer one device could not gather at all.

Static shapes: a device may receive any number of pairs, up to every gathered token's k, so the expert paths size
their row buffers for N * k of the global batch (the blocked path's gathered rows and outputs, [N * k, D]: a larger
transient than FSDP's of N / fsdp * k), and compute only the blocks that hold this device's pairs (a `lax.cond` a
block in the scan, a skipped grid program in the Pallas kernel). Expected work per device is that of FSDP.

Taken when `ModelConfig.expert_parallel` is on (the default) and the expert count divides the fsdp axis (the
expert weights' logical axis "experts" then shards over it, `models.sharding`); otherwise the experts are FSDP's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.models.sharding import BATCH_AXIS


def expert_shards(num_experts: int, row_shards: int, enabled: bool) -> int:
    """Over how many devices the experts spread: the batch axis's size when expert parallelism is on, the rows split
    over that axis (row_shards > 1) and the expert count divides it; else 1 (each device sees every expert)."""
    if not enabled or row_shards <= 1 or num_experts % row_shards:
        return 1
    return row_shards


def dispatch(path, h: jax.Array, gate, up, down, weights: jax.Array, chosen: jax.Array, act, bias: tuple, *,
             shards: int) -> jax.Array:
    """Inside the MoE layer's shard_map over the batch axis: an expert path (`models.moe`'s, same arguments) run on
    every shard's tokens for this device's experts (gate, up, down: [E / shards, ...]), then each token's partial
    outputs summed onto its own shard: [n, D] for this shard's rows h [n, D] and their weights, picks [n, k]."""
    h_all, w_all, c_all = gather_pairs(h, weights, chosen)
    local, w_local = local_pairs(c_all, w_all, gate.shape[0])
    return scatter_outputs(path(h_all, gate, up, down, w_local, local, act, bias, shards=shards))


def gather_pairs(h: jax.Array, weights: jax.Array, chosen: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inside a shard_map over the batch axis: every shard's rows h [n, D], routing weights and picks [n, k], as
    [shards * n, ...] in shard order (the same on every device)."""
    return tuple(jax.lax.all_gather(a, BATCH_AXIS, tiled=True) for a in (h, weights, chosen))


def local_pairs(chosen: jax.Array, weights: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """This device's share of the gathered pairs: its experts are `count` consecutive global ids starting at
    axis_index * count. Returns (local ids [N, k] in [0, count], `count` marking another device's expert, and the
    weights [N, k] with those pairs' set to 0)."""
    first = jax.lax.axis_index(BATCH_AXIS) * count
    local = chosen - first
    mine = (local >= 0) & (local < count)
    return jnp.where(mine, local, count).astype(jnp.int32), jnp.where(mine, weights, 0).astype(weights.dtype)


def scatter_outputs(out: jax.Array) -> jax.Array:
    """Every device's partial outputs [shards * n, D] for the gathered tokens summed, each shard's own n rows kept."""
    return jax.lax.psum_scatter(out, BATCH_AXIS, scatter_dimension=0, tiled=True)
