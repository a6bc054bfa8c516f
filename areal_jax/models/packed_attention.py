"""The training forward's choices: which attention runs over packed rows, and what each layer rematerialises.

Attention backends (`train.attention`):
  * "dense": `layers.dot_attention` with a [B, T, T] mask (scores [B, H, T, T]: memory quadratic in T).
  * "blocked": `blocked_attention` (XLA, block pairs with an empty mask skipped at run time); rows it
    cannot block (short, or a length the block does not divide) fall back to dense.
  * "flash": a Pallas kernel with linear memory: `flash_attention` (Triton lowering) on GPUs, JAX's
    splash-attention kernel on TPUs; elsewhere `flash_attention` in the Pallas interpreter (exact but
    slow: for tests).
  * "auto": blocked on the CPU (dense where it cannot block), flash on GPUs and TPUs.
Every backend takes attention sinks (`attention_sinks`): the attention functions are attend(q, k, v, sinks=None).

Rematerialisation (`train.remat`), applied to each decoder layer with `jax.checkpoint`:
  * "none": the backward reads every activation the forward stored.
  * "full": only each layer's input is kept; the backward recomputes the layer.
  * "dots": matmul outputs without batch dimensions are kept (`dots_with_no_batch_dims_saveable`: the
    q/k/v/o and MLP projections, which `layers.dense` runs as 2-D matmuls); the attention and the
    elementwise work between are recomputed.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from areal_jax.models.blocked_attention import attention_block, block_masks, blocked_attention
from areal_jax.models.flash_attention import flash_attention
from areal_jax.models.layers import dot_attention
from areal_jax.models.sharding import BATCH_AXIS, TENSOR_AXIS, batch_shards, constrain_batch, context_axis_size
from areal_jax.models.splash import splash_attention

ATTENTION_CHOICES = ("auto", "dense", "blocked", "flash")
REMAT_CHOICES = ("none", "full", "dots")

AttentionFn = Callable[..., jax.Array]  # attend(q, k, v, sinks=None): sinks [H] float32 (a layer's) or None


def resolve_attention(choice: str, t: int, backend: str | None = None) -> str:
    """The implementation `choice` means for rows of `t` tokens on `backend` (default: JAX's default
    backend): one of "dense", "blocked", "flash" (Pallas kernel of this file's docstring), "splash"."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention={choice!r} is not one of {', '.join(ATTENTION_CHOICES)}; set "
                         "--config.train.attention to one of them.")
    backend = jax.default_backend() if backend is None else backend
    if choice == "auto":
        choice = "blocked" if backend == "cpu" else "flash"
    if choice == "blocked":
        return "blocked" if attention_block(t, "cpu") else "dense"
    if choice == "flash" and backend == "tpu":
        return "splash"
    return choice


def packed_mask(segment_ids: jax.Array, window: int | None = None) -> jax.Array:
    """segment_ids: [B, T] int32 -> [B, T, T] bool: i attends j iff j <= i and both share a segment id (and, with
    a sliding window, i - j < window)."""
    t = segment_ids.shape[1]
    distance = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    causal = distance >= 0 if window is None else (distance >= 0) & (distance < window)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same


def packed_attention(segment_ids: jax.Array, choice: str = "auto", backend: str | None = None,
                     window: int | None = None, softcap: float | None = None) -> AttentionFn:
    """attention(q [B, T, H, Dh], k [B, T, K, Dh], v, sinks=None) -> [B, T, H, Dh] for rows with these segment ids
    (and a sliding window of `window` positions, or full causal attention when None; softcap: Gemma 2's
    soft-capping of the scaled scores; sinks: the calling layer's sink logits [H], `attention_sinks`).

    Whatever depends only on the segment ids (dense mask, block masks) is built here once and shared by
    every layer that calls the result.
    """
    t = segment_ids.shape[1]
    impl = resolve_attention(choice, t, backend)
    if impl == "dense":
        mask = packed_mask(segment_ids, window)
        return _pinned(lambda q, k, v, sinks=None: dot_attention(q, k, v, mask, softcap, sinks))
    if impl == "blocked":
        block = attention_block(t, "cpu")
        masks = block_masks(segment_ids, block, window)
        return _pinned(lambda q, k, v, sinks=None: blocked_attention(q, k, v, segment_ids, block, masks, window,
                                                                     softcap, sinks))
    kernel = splash_attention if impl == "splash" else flash_attention
    return per_shard(lambda q, k, v, seg, sinks=None: kernel(q, k, v, seg, window=window, softcap=softcap,
                                                             sinks=sinks), segment_ids)


def _pinned(attend: AttentionFn) -> AttentionFn:
    """attend with its inputs and output kept batch-sharded under a mesh context (models.sharding)."""
    return lambda q, k, v, sinks=None: constrain_batch(attend(constrain_batch(q), constrain_batch(k),
                                                              constrain_batch(v), sinks))


def per_shard(kernel: Callable, segment_ids: jax.Array) -> AttentionFn:
    """attention(q, k, v, sinks=None) running kernel(q, k, v, segment_ids), or given sinks [H] kernel(q, k, v,
    segment_ids, sinks), on each device's own rows and heads (and those heads' sinks).

    A Pallas kernel is a custom call XLA cannot partition: given sharded operands it gathers them and runs the whole
    batch on every device. Under a mesh context whose batch axis divides the rows, the kernel runs in a shard_map
    over that axis, and over "tensor" too when it divides both head counts (contiguous head chunks keep each query
    head with its key/value head). Without a context: the kernel as it is."""
    shards, tensor = batch_shards(), context_axis_size(TENSOR_AXIS)
    if shards == 1 or segment_ids.shape[0] % shards:
        return lambda q, k, v, sinks=None: kernel(q, k, v, segment_ids, *([] if sinks is None else [sinks]))

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
        heads = TENSOR_AXIS if tensor > 1 and q.shape[2] % tensor == 0 and k.shape[2] % tensor == 0 else None
        spec = PartitionSpec(BATCH_AXIS, None, heads, None)
        axes = frozenset({BATCH_AXIS} | ({TENSOR_AXIS} if heads else set()))
        specs, args = (spec, spec, spec, PartitionSpec(BATCH_AXIS, None)), (q, k, v, segment_ids)
        if sinks is not None:  # split with the query heads
            specs, args = (*specs, PartitionSpec(heads)), (*args, sinks)
        run = jax.shard_map(kernel, in_specs=specs, out_specs=spec, axis_names=axes, check_vma=False)
        return run(*args)

    return attend


def layer_attention(cfg, segment_ids: jax.Array, choice: str = "auto",
                    backend: str | None = None) -> list[AttentionFn]:
    """Each decoder layer's `packed_attention` (one function per distinct window, shared by its layers); a Gated
    DeltaNet layer's is its `gated_deltanet.Segments`, a hybrid layer's the pair (`layers.DecoderLayer`)."""
    from areal_jax.models.gated_deltanet import Segments  # noqa: PLC0415 (it builds on the layers this module runs)

    by_window: dict = {}  # window (or ("hybrid", window)) -> its attention
    out: list = []
    linear = Segments(segment_ids)  # a Gated DeltaNet layer's context: its segments (one object: scans see a period)
    for i in range(cfg.num_layers):
        if cfg.layer_is_linear(i):
            out.append(linear)
            continue
        w = cfg.layer_window(i)
        if w not in by_window:
            by_window[w] = packed_attention(segment_ids, choice, backend, w, cfg.attn_logit_softcap)
        if cfg.layer_is_hybrid(i) and ("hybrid", w) not in by_window:
            by_window["hybrid", w] = (by_window[w], linear)  # (one object per window too)
        out.append(by_window["hybrid", w] if cfg.layer_is_hybrid(i) else by_window[w])
    return out


def remat_policy(choice: str) -> Callable | None:
    """The `jax.checkpoint` policy of a `train.remat` choice other than "none" (None: save nothing)."""
    if choice not in REMAT_CHOICES:
        raise ValueError(f"remat={choice!r} is not one of {', '.join(REMAT_CHOICES)}; set --config.train.remat "
                         "to one of them.")
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable if choice == "dots" else None


def decoder_layer(layer: nnx.Module, x: jax.Array, rope: tuple[jax.Array, ...], attend: AttentionFn,
                  remat: str = "none", router_mask: jax.Array | None = None, routes: jax.Array | None = None,
                  replay: bool = False, record: bool = False) -> Any:
    """One decoder layer of the cache-free forward (`layers.DecoderLayer.__call__`).

    layer: a `layers.DecoderLayer`; x: [B, T, D] compute dtype; rope: its table, (cos, sin) [B, T, head_dim] float32
    (and the queries' scale [B, T] where the model has one: `rope.rope_tables`).
    With remat other than "none" the layer runs as a pure function of its state under `jax.checkpoint`.
    routes [B, T, k], replay: a mixture-of-experts layer's given experts. With router_mask [B, T] or record: (x,
    the layer's extras or None), as `DecoderLayer.__call__`.
    """
    extra = router_mask is not None or record
    cos, sin, *scale = rope
    scaled = {"query_scale": scale[0]} if scale else {}

    def apply(lyr: nnx.Module, x: jax.Array) -> Any:  # rows stay on their device (models.sharding)
        if not extra:
            return constrain_batch(lyr(constrain_batch(x), cos, sin, attend, routes=routes, replay=replay, **scaled))
        out, found = lyr(constrain_batch(x), cos, sin, attend, router_mask, routes=routes, replay=replay,
                         record=record, **scaled)
        return constrain_batch(out), found

    if remat == "none":
        return apply(layer, x)
    policy = remat_policy(remat)
    graphdef, state = nnx.split(layer)
    return jax.checkpoint(lambda s, h: apply(nnx.merge(graphdef, s), h), policy=policy)(state, x)


def is_moe_layer(layer: nnx.Module) -> bool:
    """Whether a decoder layer's feed-forward is a mixture of experts (`moe.MoE`)."""
    return hasattr(layer.mlp, "top_k")


def _stacked(found: list[dict]) -> dict | None:
    """Per-layer extras (dicts of like arrays) stacked on a leading layer axis; None without any."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *found) if found else None


def scannable(layers, period: int = 1) -> tuple[nnx.GraphDef, list[nnx.State]] | None:
    """(shared graphdef, per-layer states) when every layer has one module structure and holds parameters
    only (no RNG or other mutable state a scan would have to carry out), else None. LoRA-adapted layers differ
    in structure (each adapter has its own dropout salt), so they are not scanned. With period p > 1 the layers
    need one structure per position in a group of p (Qwen3.5's three Gated DeltaNet layers and one of attention):
    the graphdef is then a tuple of p, layer i's at i mod p."""
    if len(layers) < 2:
        return None
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0] if period == 1 else tuple(g for g, _ in splits[:period])
    if any(g != (graphdef if period == 1 else graphdef[i % period]) for i, (g, _) in enumerate(splits)):
        return None
    if any(jax.tree.leaves(nnx.state(layer, nnx.Not(nnx.Param))) for layer in layers):
        return None
    return graphdef, [state for _, state in splits]


def decoder_stack(layers, x: jax.Array, ropes: list[tuple[jax.Array, ...]], attends: list[AttentionFn],
                  remat: str = "none", scan: bool = True, router_mask: jax.Array | None = None,
                  routes: jax.Array | None = None, replay: bool = False, record: bool = False) -> Any:
    """Every decoder layer of the cache-free forward, in order; layer i reads RoPE table ropes[i] (cos, sin) and
    attends with attends[i].

    With scan (and layers of one structure, `scannable`), one `lax.scan` over the layers' states stacked on a
    leading axis: the program holds a single layer, so tracing and compiling cost about one layer's time instead
    of L (the backward too), for one stacking copy of the layer weights per call and one unstacking of their
    gradients. Layers whose tables or attentions repeat with a period p (Gemma 3's five local layers and one
    global, p = 6; OLMo 3's p = 4) scan over groups of p layers, the body running one of each, and the layers
    past the last whole group run unrolled. The results equal the unrolled loop's up to float rounding.

    routes [L_moe, B, T, k]: given experts of each mixture-of-experts layer, in order, sent to with replay
    (`moe.MoE.__call__`). With
    router_mask [B, T] or record: (x, the mixture-of-experts layers' extras stacked on a leading axis of L_moe, in
    order (`moe.MoE.__call__`: "stats" over the masked tokens, "agree", "routes"), or None without any)."""
    extra = router_mask is not None or record
    moe_index = list(itertools.accumulate((is_moe_layer(layer) for layer in layers), initial=0))

    def run(layer: nnx.Module, h: jax.Array, i: int, found: list, layer_routes: jax.Array | None) -> jax.Array:
        out = decoder_layer(layer, h, ropes[i], attends[i], remat, router_mask, layer_routes, replay, record)
        if not extra:
            return out
        if out[1] is not None:
            found.append(out[1])
        return out[0]

    def routes_of(i: int) -> jax.Array | None:
        return None if routes is None or not is_moe_layer(layers[i]) else routes[moe_index[i]]

    period = _period(ropes, attends) if scan else None
    shared = scannable(layers) if period is not None else None
    if shared is None and period is not None and period > 1 and len({is_moe_layer(y) for y in layers}) == 1:
        shared = scannable(layers, period)  # one structure per place in the group (routes index layers as below)
    found: list[dict] = []
    if shared is None:
        for i, layer in enumerate(layers):
            x = run(layer, x, i, found, routes_of(i))
        return (x, _stacked(found)) if extra else x
    graphdef, states = shared
    groups = len(layers) // period
    stacked = [jax.tree.map(lambda *xs: jnp.stack(xs), *states[j:groups * period:period]) for j in range(period)]
    # one structure: every layer has experts or none does, so layer i's routes are routes[i]
    given = None if routes is None else [routes[j:groups * period:period] for j in range(period)]

    def body(h: jax.Array, xs: tuple) -> tuple[jax.Array, Any]:
        group, group_routes = xs
        inner: list[dict] = []
        for j, state in enumerate(group):
            h = run(nnx.merge(graphdef if not isinstance(graphdef, tuple) else graphdef[j], state), h, j, inner,
                    None if group_routes is None else group_routes[j])
        return h, _stacked(inner)  # [p', ...]: the group's expert layers

    x, per_group = jax.lax.scan(body, x, (stacked, given))
    tail: list[dict] = []
    for i in range(groups * period, len(layers)):
        x = run(layers[i], x, i, tail, routes_of(i))
    if not extra:
        return x
    out = [] if per_group is None else [jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), per_group)]
    out += [_stacked(tail)] if tail else []
    return x, (jax.tree.map(lambda *xs: jnp.concatenate(xs), *out) if out else None)


def _period(ropes: list, attends: list) -> int | None:
    """The smallest p such that layer i reads the same RoPE table and attention as layer i mod p, for every layer
    of the (at least two) whole groups of p; None when there is none."""
    n = len(ropes)
    for p in range(1, n // 2 + 1):  # at least two whole groups
        whole = n // p * p
        if all(ropes[i] is ropes[i % p] and attends[i] is attends[i % p] for i in range(whole)):
            return p
    return None
