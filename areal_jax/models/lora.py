"""LoRA: low-rank adapters on the decoder's projections, with the base weights frozen.

A targeted projection W ([*in, *out], e.g. q_proj [D, H, Dh]) becomes a `LoRAProjection` holding the frozen
W (an `nnx.Param`, optionally stored in bfloat16) and two trainable `nnx.LoRAParam` factors

    A: [*in, r]  (logical axes: W's input axes, "lora_rank")    initialised U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    B: [r, *out] (logical axes: "lora_rank", W's output axes)  initialised to zeros

and computes  y = x @ W + (alpha / r) * dropout(x) @ A @ B.  With B = 0 the model is exactly the base model.
The adapters carry the logical axis names of the weight they adapt, so they shard like it ("embed" over
fsdp, "heads" / "mlp" over tensor); "lora_rank" has no rule and stays replicated.

Why our own wrapper: `flax.nnx.LoRA` adapts 2-D `nnx.Linear`-style kernels only (our q/k/v/o weights are
3-D with head axes) and needs its own module call; qwix finds weights by intercepting `dot_general` on the
param value itself, which our `layers.dense` reshapes first (see README, "LoRA"). This module keeps the
project's param layout and sharding and costs two small matmuls per projection.

Dropout (training only) draws its mask from a key derived from the layer's position in the model and the
input itself, so the jitted update needs no RNG state threaded through it; the proximal forward and the
first gradient pass of an update see the same mask, as the decoupled objective assumes. The sampler
graph has dropout off (`sampler_graphdef`).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.lora_targets import (  # noqa: F401 (re-exported: what LoRA adapts, and its config section)
    BASE_DTYPES,
    CONV,
    EXPERTS,
    GROUPS,
    LINEAR,
    MAMBA,
    PROJECTIONS,
    SHARED,
    SPLIT_LINEAR,
    LoRAConfig,
    adapter_bytes,
    attention_projections,
    expert_layers,
    linear_layers,
    linear_projections,
    mlp_projections,
    model_targets,
    module_at,
    shared_layers,
)
from areal_jax.models.sharding import logical_names


# ------------------------------------------------------------------------------------------ pure math
def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: float, n_in: int = 1) -> jax.Array:
    """scale * x @ A @ B. x: [..., *in]; a: [*in, r]; b: [r, *out] -> [..., *out] in x's dtype."""
    lead, k = x.shape[: x.ndim - n_in], math.prod(a.shape[:n_in])
    r = a.shape[n_in]
    h = x.reshape(-1, k) @ a.reshape(k, r).astype(x.dtype)
    y = (h * jnp.asarray(scale, x.dtype)) @ b.reshape(r, -1).astype(x.dtype)
    return y.reshape(*lead, *b.shape[1:])


def merge_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float, dtype: Any = None) -> jax.Array:
    """W + scale * A @ B, computed in float32 and returned in `dtype` (default W's). w: [*in, *out]."""
    n_in = a.ndim - 1
    k, r = math.prod(a.shape[:n_in]), a.shape[n_in]
    delta = (a.reshape(k, r).astype(jnp.float32) * scale) @ b.reshape(r, -1).astype(jnp.float32)
    merged = w.astype(jnp.float32) + delta.reshape(w.shape)
    return merged.astype(w.dtype if dtype is None else dtype)


def merge_experts(w: jax.Array, a: jax.Array, b: jax.Array, scale: float, dtype: Any = None) -> jax.Array:
    """Each expert's W_e + scale * A_e @ B_e, in float32, returned in `dtype` (default W's). w: [E, in, out]; a: [E, in,
    r]; b: [E, r, out]."""
    delta = jnp.einsum("eir,ero->eio", a.astype(jnp.float32) * scale, b.astype(jnp.float32))
    return (w.astype(jnp.float32) + delta).astype(w.dtype if dtype is None else dtype)


def dropout_inputs(x: jax.Array, rate: float, salt: int) -> jax.Array:
    """Inverted dropout of x with a mask keyed by (salt, a checksum of x): no RNG state needed."""
    if rate <= 0.0:
        return x
    checksum = jnp.sum(jax.lax.stop_gradient(x).astype(jnp.float32))
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0x10a), salt),
                             jax.lax.bitcast_convert_type(checksum, jnp.uint32))
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


# ------------------------------------------------------------------------------------------ the module
class LoRAProjection(nnx.Module):
    """A frozen projection weight `base` [*in, *out] plus trainable `lora_a` [*in, r] and `lora_b` [r, *out]."""

    def __init__(self, base: nnx.Param, n_in: int, cfg: LoRAConfig, *, salt: int, rngs: nnx.Rngs):
        w = base.get_value()
        names = logical_names(base) or (None,) * w.ndim
        in_shape = w.shape[:n_in]
        fan_in = math.prod(in_shape)
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), (*in_shape, cfg.rank), jnp.float32, -bound, bound)
        self.base = base
        self.lora_a = nnx.LoRAParam(a, out_sharding=(*names[:n_in], "lora_rank"), eager_sharding=False)
        self.lora_b = nnx.LoRAParam(jnp.zeros((cfg.rank, *w.shape[n_in:]), jnp.float32),
                                    out_sharding=("lora_rank", *names[n_in:]), eager_sharding=False)
        self.n_in = n_in
        self.scale = cfg.scale
        self.dropout = float(cfg.dropout)
        self.deterministic = False
        self.salt = int(salt)

    def project(self, x: jax.Array, dtype: Any, n_in: int = 1) -> jax.Array:
        """x: [..., *in] -> [..., *out] in `dtype`: x @ base + scale * dropout(x) @ A @ B."""
        from areal_jax.models.layers import dense  # noqa: PLC0415 (layers imports nothing from here)

        if n_in != self.n_in:
            raise ValueError(f"LoRAProjection adapts a weight with {self.n_in} input axes, called with n_in={n_in}.")
        x = x.astype(dtype)
        y = dense(x, self.base[...].astype(dtype), n_in)
        xd = x if self.deterministic else dropout_inputs(x, self.dropout, self.salt)
        return y + lora_delta(xd, self.lora_a[...], self.lora_b[...], self.scale, n_in)

    def merged(self, dtype: Any = None) -> jax.Array:
        """The base with the adapters folded in: [*in, *out] in `dtype` (default the base's)."""
        return merge_weight(self.base[...], self.lora_a[...], self.lora_b[...], self.scale, dtype)


class LoRAExperts(nnx.Module):
    """A mixture-of-experts layer's frozen expert weights `base` [E, in, out] plus trainable per-expert factors
    `lora_a` [E, in, r] (U(-1/sqrt(in), 1/sqrt(in))) and `lora_b` [E, r, out] (zeros), sharded like the base's expert
    and width axes. `models.moe.MoE` never forms the adapted weights: every expert path (blocked, ragged, pallas,
    dense) multiplies a token's rows by its expert's base and adds scale * (rows @ A_e) @ B_e (`moe.Factored`), so
    the backward computes only rank-r gradients (no [E, in, out] weight gradient). `merged()` folds them for the
    sampler's merged weights and the export. No dropout."""

    def __init__(self, base: nnx.Param, cfg: LoRAConfig, *, rngs: nnx.Rngs):
        w = base.get_value()
        names = logical_names(base) or (None,) * 3
        e, fan_in, fan_out = w.shape
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), (e, fan_in, cfg.rank), jnp.float32, -bound, bound)
        self.base = base
        self.lora_a = nnx.LoRAParam(a, out_sharding=(names[0], names[1], "lora_rank"), eager_sharding=False)
        self.lora_b = nnx.LoRAParam(jnp.zeros((e, cfg.rank, fan_out), jnp.float32),
                                    out_sharding=(names[0], "lora_rank", names[2]), eager_sharding=False)
        self.scale = cfg.scale

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    def merged(self, dtype: Any = None) -> jax.Array:
        """[E, in, out]: the base with each expert's adapters folded in, in `dtype` (default the base's)."""
        return merge_experts(self.base[...], self.lora_a[...], self.lora_b[...], self.scale, dtype)


def apply_lora(model: nnx.Module, cfg: LoRAConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """Wrap the targeted projections of a `Transformer` in place; returns the model.

    With cfg.base_dtype set, every frozen parameter (embeddings, norms, projections) is cast to it.
    Raises when the targets select no projection or the model already has adapters.
    """
    if has_lora(model):
        raise ValueError("The model already has LoRA adapters; apply_lora once per model.")
    targets = model_targets(model.cfg, cfg)
    if not targets:
        raise ValueError(f"lora.targets={cfg.targets!r} selects no projection of this {model.cfg.num_layers}-layer "
                         "model; paths look like 'layers.0.attn.q_proj' (a mixture-of-experts layer's experts take no "
                         "adapters: target attention there, e.g. 'attn').")
    for salt, (i, short) in enumerate(targets):
        if short in EXPERTS:
            moe = model.layers[i].mlp
            setattr(moe, short, LoRAExperts(getattr(moe, short), cfg, rngs=rngs))
            continue
        part, attr, n_in = PROJECTIONS[short]
        owner = module_at(model.layers[i], part)
        setattr(owner, attr, LoRAProjection(getattr(owner, attr), n_in, cfg, salt=salt, rngs=rngs))
    if cfg.base_dtype:
        dtype = BASE_DTYPES[cfg.base_dtype]
        for _, var in nnx.iter_graph(model):
            if type(var) is nnx.Param and var.get_value().dtype != dtype:
                var.set_value(var.get_value().astype(dtype))
    return model


def has_lora(model_or_state: Any) -> bool:
    """Whether a model (or its state) holds LoRA adapters."""
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    return bool(jax.tree.leaves(nnx.filter_state(state, nnx.LoRAParam)))


def set_dropout(model: nnx.Module, enabled: bool) -> None:
    """Turn the adapters' dropout on (training) or off (sampling, evaluation), in place."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, LoRAProjection):
            node.deterministic = not enabled


def sampler_graphdef(model: nnx.Module) -> nnx.GraphDef:
    """The graph of the adapted model with dropout off (for unmerged decoding); the model is left as it was."""
    flags = [(n, n.deterministic) for _, n in nnx.iter_graph(model) if isinstance(n, LoRAProjection)]
    set_dropout(model, False)
    graphdef = nnx.graphdef(model)
    for node, flag in flags:
        node.deterministic = flag
    return graphdef


def plain_graphdef(model_cfg: ModelConfig) -> nnx.GraphDef:
    """The graph of the same decoder without adapters (what merged weights run on)."""
    from areal_jax.models.transformer import Transformer  # noqa: PLC0415

    return nnx.graphdef(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))


def merge_state(state: nnx.State, scale: float, dtype: Any = None) -> nnx.State:
    """Fold the adapters of an adapted model's state into its base weights (pure, jittable).

    state: `nnx.state(model)` of a model with `LoRAProjection`s (values may be traced). Returns the state
    of the plain decoder (`plain_graphdef`): each adapted path `...q_proj` holds base + scale * A @ B.
    dtype: dtype of every returned param (default: unchanged; merged weights keep their base's dtype).
    """
    flat = dict(nnx.to_flat_state(state))
    out = []
    for path, var in flat.items():
        if path[-1] in ("lora_a", "lora_b"):
            continue
        if path[-1] == "base" and path[:-1] + ("lora_a",) in flat:
            a, b = flat[path[:-1] + ("lora_a",)].get_value(), flat[path[:-1] + ("lora_b",)].get_value()
            merge = merge_experts if path[-2] in EXPERTS else merge_weight
            value = merge(var.get_value(), a, b, scale, dtype)
            out.append((path[:-1], var.replace(value)))
            continue
        value = var.get_value()
        if dtype is not None and isinstance(var, nnx.Param) and hasattr(value, "astype"):
            value = value.astype(dtype)
        out.append((path, var.replace(value)))
    return nnx.from_flat_state(out)


def merged_model(model: nnx.Module, scale: float, dtype: Any = None) -> nnx.Module:
    """A plain decoder whose projections are the adapted model's merged weights (the model is unchanged)."""
    cfg = model.cfg if dtype is None else model.cfg.replace(param_dtype=dtype)
    return nnx.merge(plain_graphdef(cfg), merge_state(nnx.state(model), scale, dtype))


