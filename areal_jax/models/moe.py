"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a softmax router sends each token to its top-k experts,
gated MLPs like `layers.MLP`, and the token's output is the routing-weighted sum of theirs.

Routing follows transformers: router logits in the compute dtype (accumulated in float32), a float32 softmax over
all experts, the top k probabilities (renormalised to sum to 1 with ``norm_topk_prob``; Mixtral always
renormalises) as the weights. There is no capacity limit and no token is dropped, so a token's output depends on
that token alone: the trainer's packed rows, the sampler's decode steps and HF's forward agree whatever else is in
the batch, which the PPO ratios need.

Router statistics (`MoE(x, router_mask)`: per layer, how often each expert is picked and its summed probability over
the real tokens) give the trainer its load metrics and the optional load-balancing loss (`load_balancing_loss`,
transformers' Switch-style auxiliary loss; `train.router_aux_coef`, off by default: a reinforcement-learning update
of a trained router).

Four ways to run the experts (`ModelConfig.moe_impl`), equal up to float summation order:

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

Under a train mesh the layer runs per device in a shard_map: over rows (fsdp), over the experts' width (tensor), and
with expert parallelism over the experts (`models.expert_parallel`).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from areal_jax.models import routing
from areal_jax.models.config import ModelConfig
from areal_jax.models.expert_parallel import dispatch, expert_shards, ring_dispatch
from areal_jax.models.factored import Factored, grouped, weight_specs
from areal_jax.models.grouped_matmul import grouped_matmul, supports
from areal_jax.models.layers import MLP, make_param
from areal_jax.models.routing import load_balancing_loss, route, router_stats  # noqa: F401 (moe's API)
from areal_jax.models.sharding import BATCH_AXIS, TENSOR_AXIS, batch_shards, context_axis_size, gather_over, manual_axes

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


def moe_layer_count(cfg: ModelConfig) -> int:
    """How many of the model's layers are mixtures of experts (0 for a dense model)."""
    return sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))


def glu(limit: float | None = None, alpha: float = 1.702):
    """An expert's activation of its gate and up products: silu(g) * u (SwiGLU), or with a limit gpt-oss's
    (min(u, limit) clipped to +-limit + 1) * g' * sigmoid(alpha * g') with g' = min(g, limit)."""
    if limit is None:
        return lambda g, u: jax.nn.silu(g) * u

    def clamped(g: jax.Array, u: jax.Array) -> jax.Array:
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
        return (u + 1) * (g * jax.nn.sigmoid(g * alpha))

    return clamped


def _biased(z: jax.Array, bias: jax.Array | None, index: Any) -> jax.Array:
    """z plus bias[index] (the experts' rows of a gate or up bias [E, F]); z without a bias."""
    return z if bias is None else z + bias[index].astype(z.dtype)


def _dense_experts(x: jax.Array, gate: Any, up: Any, down: Any, weights: jax.Array, experts: jax.Array,
                   act=glu(), bias: tuple = (None, None), *, shards: int = 1) -> jax.Array:
    """Every expert on every token. x [N, D]; gate, up [E, D, F]; down [E, F, D] (arrays or `Factored`);
    weights, experts [N, k]; act: `glu`; bias: the gate and up biases [E, F] (or None each). Ids of E (expert
    parallelism's other devices' experts, weight 0) add nothing."""
    n, e = x.shape[0], gate.shape[0]
    combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], experts].add(weights)

    def spread(z, w, out_dtype):  # [N, in] or [N, E, in] by [E, in, out] -> [N, E, out]
        eq = "nd,edf->nef" if z.ndim == 2 else "ned,edf->nef"
        return jnp.einsum(eq, z, w, preferred_element_type=out_dtype).astype(out_dtype or z.dtype)

    def gather(z, w, out_dtype):  # [N, E, in] by [E, in, out] -> [N, out], summed over the experts
        return jnp.einsum("nef,efd->nd", z, w, preferred_element_type=out_dtype).astype(out_dtype or z.dtype)

    every = slice(None)
    h = act(_biased(grouped(x, gate, spread), bias[0], every), _biased(grouped(x, up, spread), bias[1], every))
    h = h * combine[:, :, None].astype(x.dtype)
    if isinstance(down, Factored):  # h's rank-r projection per expert, then the experts' sum through b
        delta = gather(spread(h, down.a, None), down.b, jnp.float32)
        return (gather(h, down.base, jnp.float32) + down.scale * delta).astype(x.dtype)
    return gather(h, down, jnp.float32).astype(x.dtype)


def _ragged_experts(x: jax.Array, gate: Any, up: Any, down: Any, weights: jax.Array, experts: jax.Array,
                    act=glu(), bias: tuple = (None, None), *, shards: int = 1) -> jax.Array:
    """The (token, expert) pairs grouped by expert through `jax.lax.ragged_dot`; same arguments as the dense path
    (ids of E sort last, past every group: ragged_dot gives their rows zeros)."""
    n, k = experts.shape
    e = gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]

    def mm(z, w, out_dtype):
        return jax.lax.ragged_dot(z, w, sizes, preferred_element_type=out_dtype).astype(out_dtype or z.dtype)

    owner = flat[order]
    h = act(_biased(grouped(xs, gate, mm), bias[0], owner), _biased(grouped(xs, up, mm), bias[1], owner))
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


def _blocked_experts(x: jax.Array, gate: Any, up: Any, down: Any, weights: jax.Array, experts: jax.Array,
                     act=glu(), bias: tuple = (None, None), *, kernel: bool = False, shards: int = 1) -> jax.Array:
    """The sorted pairs in expert-aligned blocks (`block_layout`), one `lax.scan` step a block, or with `kernel` the
    grouped-matmul Pallas kernel over all blocks at once; same arguments as the dense path. Rows move by gathers
    (pair -> padded row, padded row -> token), never by float scatters. shards > 1 (expert parallelism): x holds the
    tokens of `shards` devices and an expert id of E marks another device's expert (`expert_parallel.local_pairs`):
    those pairs' blocks are skipped and their outputs are zeros."""
    n, k = experts.shape
    e = gate.shape[0]
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
        h = act(_biased(grouped(xs, gate, mm), bias[0], per_row), _biased(grouped(xs, up, mm), bias[1], per_row))
        ys = grouped(h, down, mm, jnp.float32)
    else:
        def body(_, inp):
            xb, j = inp

            def mm(z, w, out_dtype):
                return jnp.dot(z, w[j], preferred_element_type=out_dtype).astype(out_dtype or z.dtype)

            hb = act(_biased(grouped(xb, gate, mm), bias[0], j), _biased(grouped(xb, up, mm), bias[1], j))
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


def _pallas_experts(x: jax.Array, gate: Any, up: Any, down: Any, weights: jax.Array, experts: jax.Array,
                    act=glu(), bias: tuple = (None, None), *, shards: int = 1) -> jax.Array:
    """The blocked layout through the grouped-matmul kernel (`grouped_matmul`), where its tiles fit the widths
    (multiples of 16; with `Factored` weights, the rank too), else the scan."""
    d, f = gate.shape[1], gate.shape[2]
    fits = supports(16, d, f) and supports(16, f, d)
    if isinstance(gate, Factored):
        r = gate.a.shape[2]
        fits = fits and all(supports(16, *dims) for dims in ((d, r), (r, f), (f, r), (r, d)))
    return _blocked_experts(x, gate, up, down, weights, experts, act, bias, kernel=fits, shards=shards)


def _router_logits(h: jax.Array, router: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """[N, E] float32 router logits of tokens h [N, D] through router [D, E] (accumulated in float32), plus the
    router's bias [E] (gpt-oss) when it has one."""
    logits = jnp.dot(h, router, preferred_element_type=jnp.float32)
    return logits if bias is None else logits + bias.astype(jnp.float32)


def _weight(p: Any, dtype: Any) -> Any:
    """A parameter's value in `dtype`; LoRA-adapted experts (`lora.LoRAExperts`) as a `Factored` weight."""
    if hasattr(p, "lora_a"):
        return Factored(*(v[...].astype(dtype) for v in (p.base, p.lora_a, p.lora_b)), p.scale)
    return p[...].astype(dtype)


_PATHS = {"dense": _dense_experts, "ragged": _ragged_experts, "blocked": _blocked_experts,
          "pallas": _pallas_experts}


class MoE(nnx.Module):
    """The experts' feed-forward of one layer. Parameters: router [D, E]; experts_gate, experts_up [E, D, F];
    experts_down [E, F, D] (logical axes "experts" (over fsdp: `models.expert_parallel`; None without
    expert_parallel), "embed", "mlp": else an expert's weights shard like a dense MLP's); with
    `ModelConfig.shared_expert_size`, shared_expert (an MLP) and its gate [D, 1] (none unless shared_expert_gated); with router_score_bias, router_score_bias [E] float32 (picks only:
    `routing.route`); with `ModelConfig.expert_bias` (gpt-oss), router_bias [E], experts_gate_bias, experts_up_bias [E, F] and
    experts_down_bias [E, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e, pdt = cfg.hidden_size, cfg.expert_size, cfg.num_experts, cfg.param_dtype
        self.dtype = cfg.dtype
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.impl = cfg.moe_impl
        self.expert_parallel, self.ring = cfg.expert_parallel, cfg.expert_dispatch == "ring"
        self.scoring = routing.Scoring(cfg.router_scoring, cfg.router_groups, float(cfg.routed_scaling_factor))
        self.router = make_param(rngs, (d, e), ("embed", None), pdt)
        # float32 whatever param_dtype: its small differences between experts decide picks
        self.router_score_bias = make_param(rngs, (e,), (None,), jnp.float32, init="zeros") if cfg.router_score_bias else None
        ex = "experts" if cfg.expert_parallel else None  # the experts' axis shards over fsdp (models.expert_parallel)
        self.experts_gate = make_param(rngs, (e, d, f), (ex, "embed", "mlp"), pdt)
        self.experts_up = make_param(rngs, (e, d, f), (ex, "embed", "mlp"), pdt)
        self.experts_down = make_param(rngs, (e, f, d), (ex, "mlp", "embed"), pdt)
        self.swiglu = (cfg.swiglu_limit, cfg.swiglu_alpha)  # `glu`'s arguments (a function would make layers differ)
        if cfg.expert_bias:
            self.router_bias = make_param(rngs, (e,), (None,), pdt, init="zeros")
            self.experts_gate_bias = make_param(rngs, (e, f), (ex, "mlp"), pdt, init="zeros")
            self.experts_up_bias = make_param(rngs, (e, f), (ex, "mlp"), pdt, init="zeros")
            self.experts_down_bias = make_param(rngs, (e, d), (ex, "embed"), pdt, init="zeros")
        else:
            self.router_bias = self.experts_gate_bias = self.experts_up_bias = self.experts_down_bias = None
        if cfg.shared_expert_size:  # every token also goes through one MLP (Qwen2-MoE: scaled by a sigmoid gate)
            self.shared_expert = MLP(cfg.replace(intermediate_size=cfg.shared_expert_size), rngs=rngs)
            self.shared_expert_gate = make_param(rngs, (d, 1), ("embed", None), pdt) if cfg.shared_expert_gated else None
        else:
            self.shared_expert = self.shared_expert_gate = None

    def routing(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights, experts), each [..., k], of tokens x [..., D]."""
        h = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        bias = None if self.router_bias is None else self.router_bias[...]
        score_bias = None if self.router_score_bias is None else self.router_score_bias[...]
        weights, experts = route(_router_logits(h, self.router[...].astype(self.dtype), bias), self.top_k,
                                 self.renormalize, self.scoring, score_bias)
        return weights.reshape(*x.shape[:-1], -1), experts.reshape(*x.shape[:-1], -1)

    def __call__(self, x: jax.Array, router_mask: jax.Array | None = None, *, routes: jax.Array | None = None,
                 replay: bool = False, record: bool = False) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """x: [..., D] -> [..., D] in the compute dtype.

        routes [..., k] int32: experts another forward chose for each token (e.g. the sampler's). With replay the
        tokens go to them (rollout routing replay), weighted by this router's scores of them (`routing.weights_of`:
        renormalised over the k with norm_topk_prob), so the router still gets gradients; otherwise each token
        goes to this router's own top k.
        With router_mask [...] or record, returns (out, extras): "stats" (router_mask) the layer's `router_stats`
        [2, E] over the tokens where it is set, from the routing the experts ran with (one router product);
        "agree" (router_mask and routes) [] how many of those tokens' top-k picks of this router are among the
        given routes; "routes" (record) [..., k] int32 the experts each token went to."""
        if replay and routes is None:
            raise ValueError("MoE replay needs routes= (the experts to send each token to).")
        h = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        k, renormalize, stats, scoring = self.top_k, self.renormalize, router_mask is not None, self.scoring
        mask = (jnp.zeros(h.shape[0], bool) if router_mask is None else router_mask.reshape(-1)).astype(jnp.float32)
        given = (jnp.zeros((h.shape[0], k), jnp.int32) if routes is None
                 else jnp.asarray(routes, jnp.int32).reshape(h.shape[0], k))

        params = [_weight(p, self.dtype) for p in (self.router, self.experts_gate, self.experts_up, self.experts_down)]
        biases = [None if b is None else b[...].astype(self.dtype) for b in (
            self.router_bias, self.experts_gate_bias, self.experts_up_bias, self.experts_down_bias)]
        score_bias = None if self.router_score_bias is None else self.router_score_bias[...]
        shards, tensor = batch_shards(), context_axis_size(TENSOR_AXIS)
        by_rows = shards > 1 and h.shape[0] % shards == 0
        by_width = tensor > 1 and self.experts_gate.shape[2] % tensor == 0
        ep = expert_shards(self.experts_gate.shape[0], shards if by_rows else 1, self.expert_parallel)
        path = _PATHS[resolve_moe_impl(self.impl, tokens=h.shape[0] // shards if by_rows else h.shape[0],
                                       expert_parallel=ep > 1)]

        axes = frozenset(({BATCH_AXIS} if by_rows else set()) | ({TENSOR_AXIS} if by_width else set()))
        layer = (self.router, self.experts_gate, self.experts_up, self.experts_down, self.router_bias,
                 self.experts_gate_bias, self.experts_up_bias, self.experts_down_bias)
        placed = [weight_specs(p, axes) for p in layer] if by_rows or by_width else [PartitionSpec()] * 8

        def experts(h, mask, given, *weights_and_bias):
            # FSDP shards gathered here (not by the in_specs, whose transpose would all-reduce whole gradients where
            # this reduce-scatters them); expert parallelism keeps each device's experts (dimension 0) as they are
            own = (0,) if ep > 1 else ()  # router, gate, up, down, router_bias, gate_bias, up_bias, down_bias:
            keep = [(), own, own, own, (), own, own, ()]
            router, gate, up, down, router_bias, gate_bias, up_bias, down_bias, score_bias = (*(
                w if w is None or not by_rows else jax.tree.map(
                    lambda a, s, kept=kept: gather_over(a, s, BATCH_AXIS, kept), w, spec)
                for w, spec, kept in zip(weights_and_bias, placed, keep)), weights_and_bias[-1])
            logits = _router_logits(h, router, router_bias)
            if not replay:
                weights, chosen = route(logits, k, renormalize, scoring, score_bias)
            else:
                chosen = given
                weights = routing.weights_of(routing.scores_of(logits, scoring), chosen, renormalize, scoring)
            run = functools.partial(ring_dispatch if self.ring else dispatch, path, shards=ep) if ep > 1 else path
            out = run(h, gate, up, down, weights, chosen, glu(*self.swiglu), (gate_bias, up_bias))
            out = jax.lax.psum(out, TENSOR_AXIS) if by_width else out  # each width shard's share of down
            if down_bias is not None:  # after the sum over width shards: each token's experts' biases, weighted
                out = out + jnp.einsum("nk,nkd->nd", weights, down_bias[chosen].astype(jnp.float32)).astype(out.dtype)
            # this shard's rows' statistics, on a leading axis of one per row shard (summed outside)
            layer_stats = router_stats(logits, k, mask, chosen, scoring) if stats else jnp.zeros((2, 1), jnp.float32)
            agree = jnp.zeros((), jnp.float32)
            if stats and routes is not None:  # this router's own picks: what it routed with unless replaying
                own = route(logits, k, renormalize, scoring, score_bias)[1] if replay else chosen
                hits = jnp.any(own[:, :, None] == given[:, None, :], axis=-1).sum(axis=-1)
                agree = jnp.sum(hits * mask)
            return out, layer_stats[None], agree[None], chosen

        if by_rows or by_width:
            # Under a mesh context (models.sharding) each device routes and computes its own tokens: the top-k, the
            # sort and the blocks would otherwise span the global batch, which XLA gathers to every device. The
            # weights come in as placed (`factored.weight_specs`): FSDP shards gathered inside, or with expert
            # parallelism each device's own experts; with a tensor axis dividing the experts' width each device runs
            # its slice of every expert (gate and up by columns, down by rows, the outputs summed), so a kernel too
            # sees only its slice.
            rows = PartitionSpec(BATCH_AXIS if by_rows else None, None)
            specs = (rows, PartitionSpec(rows[0]), rows, *placed, PartitionSpec())
            experts = jax.shard_map(experts, in_specs=specs, out_specs=(rows, PartitionSpec(rows[0]), PartitionSpec(
                rows[0]), rows), axis_names=manual_axes(axes, self.dtype), check_vma=False)
        out, layer_stats, agree, chosen = experts(h, mask, given, *params, *biases, score_bias)
        if self.shared_expert_gate is not None:
            scale = jax.nn.sigmoid(jnp.dot(h, self.shared_expert_gate[...].astype(self.dtype)))
            out = out + scale * self.shared_expert(h)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(h)
        out = out.reshape(x.shape)
        if not stats and not record:
            return out
        extras = {}
        if stats:
            extras["stats"] = layer_stats.sum(axis=0)
            if routes is not None:
                extras["agree"] = agree.sum()
        if record:
            extras["routes"] = chosen.reshape(*x.shape[:-1], k)
        return out, extras
