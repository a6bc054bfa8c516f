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

The experts run one of four ways (`ModelConfig.moe_impl`: blocked, ragged, pallas, dense; `models.expert_paths`).

Under a train mesh the layer runs per device in a shard_map: over rows (fsdp), over the experts' width (tensor), and
with expert parallelism over the experts (`models.expert_parallel`).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from areal_jax.models import routing
from areal_jax.models.config import ModelConfig
from areal_jax.models.expert_parallel import dispatch, expert_shards, ring_dispatch
from areal_jax.models.expert_paths import (  # noqa: F401 (moe's API)
    DENSE_DECODE_TOKENS,
    MAX_EXPERT_BLOCK,
    PATHS,
    block_layout,
    expert_block,
    glu,
    resolve_moe_impl,
)
from areal_jax.models.factored import Factored, weight_specs
from areal_jax.models.layers import MLP, make_param
from areal_jax.models.routing import load_balancing_loss, route, router_stats  # noqa: F401 (moe's API)
from areal_jax.models.sharding import BATCH_AXIS, TENSOR_AXIS, batch_shards, context_axis_size, gather_over, manual_axes


def moe_layer_count(cfg: ModelConfig) -> int:
    """How many of the model's layers are mixtures of experts (0 for a dense model)."""
    return sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))


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


class MoE(nnx.Module):
    """The experts' feed-forward of one layer. Parameters: router [D, E]; experts_gate (None for ungated experts:
    Nemotron-H's relu(x @ up)^2), experts_up [E, D, F];
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
        self.scoring = routing.Scoring(cfg.router_scoring, cfg.router_groups, float(cfg.routed_scaling_factor),
                                       float(cfg.router_jitter), 1e-6 if cfg.architecture == "lfm2_moe" else None)
        self.router = make_param(rngs, (d, e), ("embed", None), pdt)
        # float32 whatever param_dtype: its small differences between experts decide picks
        self.router_score_bias = make_param(rngs, (e,), (None,), jnp.float32, init="zeros") if cfg.router_score_bias else None
        ex = "experts" if cfg.expert_parallel else None  # the experts' axis shards over fsdp (models.expert_parallel)
        gated = cfg.gated_mlp  # (Nemotron-H's experts: down(relu(x @ up) ** 2), no gate)
        self.experts_gate = make_param(rngs, (e, d, f), (ex, "embed", "mlp"), pdt) if gated else None
        self.experts_up = make_param(rngs, (e, d, f), (ex, "embed", "mlp"), pdt)
        self.experts_down = make_param(rngs, (e, f, d), (ex, "mlp", "embed"), pdt)
        self.swiglu = (cfg.swiglu_limit, cfg.swiglu_alpha, gated)  # `glu`'s arguments (a function would make layers differ)
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

        params = [None if p is None else _weight(p, self.dtype)
                  for p in (self.router, self.experts_gate, self.experts_up, self.experts_down)]
        biases = [None if b is None else b[...].astype(self.dtype) for b in (
            self.router_bias, self.experts_gate_bias, self.experts_up_bias, self.experts_down_bias)]
        score_bias = None if self.router_score_bias is None else self.router_score_bias[...]
        shards, tensor = batch_shards(), context_axis_size(TENSOR_AXIS)
        by_rows = shards > 1 and h.shape[0] % shards == 0
        by_width = tensor > 1 and self.experts_up.shape[2] % tensor == 0
        ep = expert_shards(self.experts_up.shape[0], shards if by_rows else 1, self.expert_parallel)
        path = PATHS[resolve_moe_impl(self.impl, tokens=h.shape[0] // shards if by_rows else h.shape[0],
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
                weights = routing.replay_weights(logits, chosen, renormalize, scoring)
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
