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

import dataclasses
import math
import re
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.knobs import ConfigError, Section, knob, require
from areal_jax.models.config import ModelConfig
from areal_jax.models.sharding import logical_names

PROJECTIONS = {  # short name -> (sub-module, attribute, number of input axes)
    "q": ("attn", "q_proj", 1), "k": ("attn", "k_proj", 1), "v": ("attn", "v_proj", 1), "o": ("attn", "o_proj", 2),
    "gate": ("mlp", "gate_proj", 1), "up": ("mlp", "up_proj", 1), "down": ("mlp", "down_proj", 1),
    # latent attention's (models.mla)
    "q_a": ("attn", "q_a_proj", 1), "q_b": ("attn", "q_b_proj", 1), "kv_a": ("attn", "kv_a_proj", 1),
    "kv_b": ("attn", "kv_b_proj", 1),
    # a Gated DeltaNet layer's (models.gated_deltanet: Qwen3.5's linear attention), named also as HF does
    "in_qkv": ("linear_attn", "in_proj_qkv", 1), "in_z": ("linear_attn", "in_proj_z", 1),
    "in_b": ("linear_attn", "in_proj_b", 1), "in_a": ("linear_attn", "in_proj_a", 1),
    "out": ("linear_attn", "out_proj", 1),
}
LINEAR = ("in_qkv", "in_z", "in_b", "in_a", "out")
_BY_ATTR = {attr: short for short, (part, attr, _) in PROJECTIONS.items() if part == "linear_attn"}
# a mixture-of-experts layer's stacked expert weights [E, in, out] (models.moe.MoE), adapted per expert
EXPERTS = ("experts_gate", "experts_up", "experts_down")
GROUPS = {"attn": ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b") + LINEAR, "linear": LINEAR,
          "mlp": ("gate", "up", "down"), "all": tuple(PROJECTIONS), "experts": EXPERTS}
BASE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Section):
    """Adapter settings (the config's `lora` section); `apply_lora` reads rank, alpha, dropout, targets and
    base_dtype, the job reads `enabled` and `sampler`."""

    section: ClassVar[str] = "lora"

    enabled: bool = knob(False, "train LoRA adapters on a frozen base; off: full fine-tuning")
    rank: int = knob(16, "r, the inner dimension of A and B (>= 1)")
    alpha: float = knob(32.0, "the update is (alpha / rank) * x @ A @ B")
    dropout: float = knob(0.0, "probability of zeroing an input of the adapter path while training, in [0, 1)")
    targets: str = knob("all", "q,k,v,o,gate,up,down | attn (Gated DeltaNet's too) | linear (Gated DeltaNet's: "
                        "in_qkv,in_z,in_b,in_a,out) | mlp | all | experts (a mixture of experts' expert weights, not "
                        "in all) | re:<regex over 'layers.0.attn.q_proj'> (comma-separated)")
    base_dtype: str = knob("", "frozen base storage: '' (model.param_dtype) | float32 | bfloat16",
                           choices=("", *BASE_DTYPES))
    sampler: str = knob("merged", "merged (adapters folded into the sampler's copy at hand-off) | unmerged",
                        choices=("merged", "unmerged"))

    def check(self) -> None:
        require(self.rank >= 1, f"{self.key('rank')}={self.rank!r} must be a positive integer.")
        require(self.alpha > 0, f"{self.key('alpha')}={self.alpha!r} must be positive.")
        require(0.0 <= self.dropout < 1.0, f"{self.key('dropout')}={self.dropout!r} must lie in [0, 1).")
        try:
            names, _ = self.target_rules()
        except ValueError as err:  # each message starts with the key: "lora.targets entry ..."
            raise ConfigError(f"--config.{err}") from None
        require(not (self.dropout > 0 and names & set(EXPERTS)),
                f"{self.key('dropout')}={self.dropout} applies to projections only: the experts' adapters are folded "
                f"into their weights in each forward (no per-token input to drop); set {self.key('dropout')}=0 or "
                f"leave 'experts' out of {self.key('targets')}.")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    def target_rules(self) -> tuple[set[str], list[re.Pattern]]:
        """(short projection names, compiled path patterns) named by `targets`."""
        names, patterns = set(), []
        entries = [e.strip() for e in str(self.targets).split(",") if e.strip()]
        if not entries:
            raise ValueError("lora.targets is empty; name projections, e.g. 'q,v', 'attn', 'all' or 're:layers\\.0\\..*'.")
        for entry in entries:
            if entry.startswith("re:"):
                try:
                    patterns.append(re.compile(entry[3:]))
                except re.error as err:
                    raise ValueError(f"lora.targets entry {entry!r} is not a valid regular expression: {err}.") from err
            elif entry in GROUPS:
                names.update(GROUPS[entry])
            elif entry.removesuffix("_proj") in PROJECTIONS:
                names.add(entry.removesuffix("_proj"))
            elif entry in _BY_ATTR:  # in_proj_qkv, out_proj, ...: HF's names
                names.add(_BY_ATTR[entry])
            elif entry in EXPERTS:
                names.add(entry)
            else:
                raise ValueError(f"lora.targets entry {entry!r} is unknown; use {', '.join(PROJECTIONS)}, "
                                 f"{', '.join(GROUPS)} or 're:<regex>' over paths like 'layers.0.attn.q_proj'.")
        return names, patterns

    def target_paths(self, num_layers: int, experts: Sequence[int] = (), attention: Sequence[str] = ("q", "k", "v", "o"),
                     mlp: Sequence[str] = ("gate", "up", "down"), linear: Sequence[int] = ()) -> list[tuple[int, str]]:
        """The (layer, short name) pairs adapted in a model of `num_layers` layers, in model order. experts: the
        layers whose feed-forward is a mixture of experts (`ModelConfig.layer_is_moe`): their gate / up / down are
        the stacked expert weights, adapted only when named as experts_gate / experts_up / experts_down (the group
        "experts", or a pattern over 'layers.1.mlp.experts_gate'). attention: the model's attention projections
        (`attention_projections`); naming another one is an error. mlp: a dense MLP's projections (no gate in
        Arcee's: `mlp_projections`), the others skipped. linear: the Gated DeltaNet layers (Qwen3.5's): their token
        mixer's projections are in_qkv, in_z, in_b, in_a and out (`LINEAR`, under 'layers.0.linear_attn')."""
        names, patterns = self.target_rules()
        named = {e.strip().removesuffix("_proj") for e in str(self.targets).split(",")}
        named |= {_BY_ATTR[e.strip()] for e in str(self.targets).split(",") if e.strip() in _BY_ATTR}
        foreign = sorted(s for s in named & set(PROJECTIONS) if PROJECTIONS[s][0] == "attn" and s not in attention)
        if foreign:
            raise ValueError(f"lora.targets names {', '.join(foreign)}, which this model's attention does not have; "
                             f"its projections are {', '.join(attention)} (or use 'attn').")
        if not linear and named & set(LINEAR):
            raise ValueError(f"lora.targets names {', '.join(sorted(named & set(LINEAR)))}, the projections of Gated "
                             f"DeltaNet layers, which this model does not have; its attention's are "
                             f"{', '.join(attention)} (or use 'attn').")
        out = []
        for i in range(num_layers):
            moe = i in experts
            for short, (part, attr, _) in PROJECTIONS.items():
                if (part == "mlp" and (moe or short not in mlp) or part == "attn" and (short not in attention or i in linear)
                        or part == "linear_attn" and i not in linear):
                    continue
                path = f"layers.{i}.{part}.{attr}"
                if short in names or any(p.fullmatch(path) for p in patterns):
                    out.append((i, short))
            for short in EXPERTS if moe else ():
                if short in names or any(p.fullmatch(f"layers.{i}.mlp.{short}") for p in patterns):
                    out.append((i, short))
        return out


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
    targets = cfg.target_paths(model.cfg.num_layers, expert_layers(model.cfg), attention_projections(model.cfg),
                               mlp_projections(model.cfg), linear_layers(model.cfg))
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
        owner = getattr(model.layers[i], part)
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


def adapter_bytes(model_cfg: ModelConfig, cfg: LoRAConfig, itemsize: int = 4) -> int:
    """Bytes of every A and B of a decoder of shape `model_cfg` (float32 adapters: itemsize 4)."""
    d, f, h, k, hd = (model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.num_heads,
                      model_cfg.num_kv_heads, model_cfg.head_dim)
    e, fe = model_cfg.num_experts or 0, model_cfg.expert_size if model_cfg.num_experts else 0
    gated = 2 if model_cfg.gated_attention else 1  # Qwen3.5's q_proj gives each head's gate too
    dims = {"q": (d, gated * h * hd), "k": (d, k * hd), "v": (d, k * hd), "o": (h * hd, d), "gate": (d, f), "up": (d, f),
            "down": (f, d), "experts_gate": (e * d, e * fe), "experts_up": (e * d, e * fe),
            "experts_down": (e * fe, e * d)}
    if model_cfg.linear is not None:
        from areal_jax.models.gated_deltanet import channels  # noqa: PLC0415 (it imports layers, which imports here)

        lin = model_cfg.linear
        dims.update(in_qkv=(d, channels(model_cfg)), in_z=(d, lin.value_heads * lin.value_dim),
                    in_b=(d, lin.value_heads), in_a=(d, lin.value_heads), out=(lin.value_heads * lin.value_dim, d))
    if model_cfg.mla is not None:
        m = model_cfg.mla
        dims.update(q_a=(d, m.q_lora_rank or 0), q_b=(m.q_lora_rank or 0, h * hd), kv_a=(d, m.kv_lora_rank + m.rope),
                    kv_b=(m.kv_lora_rank, h * (m.nope + m.v)), o=(h * m.v, d))
    paths = cfg.target_paths(model_cfg.num_layers, expert_layers(model_cfg), attention_projections(model_cfg),
                             mlp_projections(model_cfg), linear_layers(model_cfg))
    return sum(cfg.rank * sum(dims[s]) * itemsize for _, s in paths)


def attention_projections(model_cfg: ModelConfig) -> tuple[str, ...]:
    """The short names of a layer's attention projections: q, k, v, o; latent attention's q (or q_a and q_b with a
    query rank), kv_a, kv_b, o."""
    if model_cfg.mla is None:
        return ("q", "k", "v", "o")
    return (("q",) if model_cfg.mla.q_lora_rank is None else ("q_a", "q_b")) + ("kv_a", "kv_b", "o")


def mlp_projections(model_cfg: ModelConfig) -> tuple[str, ...]:
    """The short names of a dense MLP's projections: gate, up, down; up and down where it has no gate (Arcee)."""
    from areal_jax.models.arcee import UNGATED  # noqa: PLC0415

    return ("up", "down") if model_cfg.architecture in UNGATED else ("gate", "up", "down")


def linear_layers(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The Gated DeltaNet layers of `model_cfg` (their projections are `LINEAR`'s, not attention's)."""
    return tuple(i for i in range(model_cfg.num_layers) if model_cfg.layer_is_linear(i))


def expert_layers(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The layers of `model_cfg` whose feed-forward is a mixture of experts (their MLP's adapters are per expert)."""
    return tuple(i for i in range(model_cfg.num_layers) if model_cfg.layer_is_moe(i))
