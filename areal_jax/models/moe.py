"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a softmax router sends each token to its top-k experts,
gated MLPs like `layers.MLP`, and the token's output is the routing-weighted sum of theirs.

Routing follows transformers: router logits in the compute dtype (accumulated in float32), a float32 softmax over
all experts, the top k probabilities (renormalised to sum to 1 with ``norm_topk_prob``; Mixtral always
renormalises) as the weights. There is no capacity limit and no token is dropped, so a token's output depends on
that token alone: the trainer's packed rows, the sampler's decode steps and HF's forward agree whatever else is in
the batch, which the PPO ratios need. No load-balancing loss is added (a reinforcement-learning update of a
trained router; HF adds one only when asked for router logits).

Two ways to run the experts (`ModelConfig.moe_impl`), equal up to float summation order:

- ``dense``: every expert on every token, outputs weighted by the routing weights (zero off the top k).
  num_experts / num_experts_per_tok times the matmul work, plain dots with static shapes: the CPU's choice and a
  reference.
- ``ragged``: the (token, expert) pairs sorted by expert, each expert's rows multiplied by its weights with
  `jax.lax.ragged_dot`, and summed back per token (`jax.ops.segment_sum`): the top-k work only, where the backend
  has a grouped matmul for ragged_dot (TPU); XLA:GPU may expand it densely.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.layers import make_param


def resolve_moe_impl(choice: str, backend: str | None = None) -> str:
    """The expert computation `choice` stands for on `backend` (default JAX's): "auto" is dense on the CPU."""
    if choice != "auto":
        return choice
    backend = jax.default_backend() if backend is None else backend
    return "dense" if backend == "cpu" else "ragged"


def route(logits: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] float32, experts [N, k] int32) of router logits [N, E]: the top k softmax probabilities,
    renormalised over the k when asked. Ties go to the lower expert index (as torch.topk on CPU)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _dense_experts(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, weights: jax.Array,
                   experts: jax.Array) -> jax.Array:
    """Every expert on every token. x [N, D]; gate, up [E, D, F]; down [E, F, D]; weights, experts [N, k]."""
    n, e = x.shape[0], gate.shape[0]
    combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], experts].add(weights)
    g = jnp.einsum("nd,edf->nef", x, gate)
    u = jnp.einsum("nd,edf->nef", x, up)
    h = jax.nn.silu(g) * u * combine[:, :, None].astype(x.dtype)
    return jnp.einsum("nef,efd->nd", h, down, preferred_element_type=jnp.float32).astype(x.dtype)


def _ragged_experts(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, weights: jax.Array,
                    experts: jax.Array) -> jax.Array:
    """The (token, expert) pairs grouped by expert through `jax.lax.ragged_dot`; same arguments as the dense path."""
    n, k = experts.shape
    e = gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
    y = jax.lax.ragged_dot(h, down, sizes, preferred_element_type=jnp.float32)
    y = y * weights.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(y, token, num_segments=n).astype(x.dtype)


class MoE(nnx.Module):
    """The experts' feed-forward of one layer. Parameters: router [D, E]; experts_gate, experts_up [E, D, F];
    experts_down [E, F, D] (logical axes "experts" (replicated by default), "embed", "mlp": an expert's weights
    shard like a dense MLP's)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e, pdt = cfg.hidden_size, cfg.expert_size, cfg.num_experts, cfg.param_dtype
        self.dtype = cfg.dtype
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.impl = cfg.moe_impl
        self.router = make_param(rngs, (d, e), ("embed", None), pdt)
        self.experts_gate = make_param(rngs, (e, d, f), ("experts", "embed", "mlp"), pdt)
        self.experts_up = make_param(rngs, (e, d, f), ("experts", "embed", "mlp"), pdt)
        self.experts_down = make_param(rngs, (e, f, d), ("experts", "mlp", "embed"), pdt)

    def routing(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights, experts), each [..., k], of tokens x [..., D]."""
        h = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        logits = jnp.dot(h, self.router[...].astype(self.dtype), preferred_element_type=jnp.float32)
        weights, experts = route(logits, self.top_k, self.renormalize)
        return weights.reshape(*x.shape[:-1], -1), experts.reshape(*x.shape[:-1], -1)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in the compute dtype."""
        weights, experts = self.routing(x)
        k = self.top_k
        h = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        run = _dense_experts if resolve_moe_impl(self.impl) == "dense" else _ragged_experts
        out = run(h, self.experts_gate[...].astype(self.dtype), self.experts_up[...].astype(self.dtype),
                  self.experts_down[...].astype(self.dtype), weights.reshape(-1, k), experts.reshape(-1, k))
        return out.reshape(x.shape)
