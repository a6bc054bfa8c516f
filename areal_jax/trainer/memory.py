"""Device memory of the PPO update, read from XLA's own buffer assignment before anything runs.

The update's working memory (activations kept for the backward, the logits chunks, scratch) depends on
the backend's fusion and scheduling, so no formula predicts it well across CPUs, GPUs and TPUs. XLA
reports it exactly for a compiled program (`memory_analysis().temp_size_in_bytes`). Compiling the
full-depth update only to learn that it does not fit would cost the very compile a user waits for, so
`activation_bytes` compiles the micro-step program of a 1-layer and a 2-layer copy of the model
(abstract: nothing is allocated) at the run's worst micro-step (one row of micro_batch_tokens per data
device) and extends the difference to every layer (2- and 3-layer copies with train.scan_layers, since
one layer is not a scan). The optimizer step (gradient clipping, AdamW) is a program of its own whose
buffers grow with the trained params; it is probed the same way (2 and 3 layers) and the larger of the
two counts. The layers are identical, so the extension is exact where XLA's scheduling is
the same per layer: within 1% of the full-depth program in tests/test_update_memory.py, and equal at the
Qwen2.5-0.5B shape on the CPU (docs/measurements.md).

`choose_remat` uses it for `train.remat=auto`: the least recomputation whose update fits the device
next to the memory already held, on devices that report their memory (GPUs, TPUs). A CPU reports none:
there "auto" is "none" and nothing is compiled. (XLA:CPU's scheduler does not shorten the activations'
lives under rematerialisation anyway; measured, the three choices need the same memory there.)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models.config import ModelConfig
from areal_jax.models.moe import moe_layer_count
from areal_jax.models.sharding import logical_to_mesh_sharding
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.logprobs import init_value_head
from areal_jax.trainer.optim import make_optimizer, make_schedule
from areal_jax.trainer.state import TrainState, train_state_shardings
from areal_jax.trainer.update import CRITIC_FIELDS, LOSS_FIELDS, build_update_fns, model_fields

REMAT_ORDER = ("none", "dots", "full")  # least recomputation first
INT_FIELDS = ("tokens", "positions", "segment_ids", "targets", "versions", "routes")

ModelBuilder = Callable[[ModelConfig], nnx.Module]


def device_memory_bytes(limit_gib: float | None = None, devices: Sequence[jax.Device] | None = None) -> int | None:
    """`limit_gib` GiB when given, else the smallest memory limit among `devices` (default: this process's),
    or None where a device does not report one (the CPU)."""
    if limit_gib is not None:
        return int(limit_gib * 2**30)
    limits = []
    for d in devices if devices is not None else jax.local_devices():
        stats = d.memory_stats() or {}
        if not stats.get("bytes_limit"):
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def per_device_bytes(shapes: Any, shardings: Any = None) -> int:
    """Bytes of one device's shards of the arrays (or ShapeDtypeStructs) `shapes`, laid out by `shardings`
    (same structure; default each leaf's own .sharding), from shapes alone."""
    leaves = jax.tree.leaves(shapes)
    layouts = [x.sharding for x in leaves] if shardings is None else jax.tree.leaves(shardings)
    return int(sum(int(np.prod(s.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize for x, s in zip(leaves, layouts)))


def resident_bytes(tree: Any) -> int:
    """Bytes of live arrays' shards held on each array's first device (what a device really holds)."""
    total = 0
    for x in jax.tree.leaves(tree):
        first = min(x.sharding.device_set, key=lambda d: d.id)
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == first)
    return total


def batch_fields(cfg: TrainerConfig) -> tuple[str, ...]:
    """The arrays of one placed micro-step, as `Trainer.update` hands them to the accumulate program."""
    fields = model_fields(cfg) + LOSS_FIELDS
    if cfg.critic == "value_head":
        fields += CRITIC_FIELDS
    if cfg.recomputes_prox:
        fields += ("prox_logp",)
    if cfg.kl_coef > 0:
        fields += ("ref_logp",)
    return fields


def batch_structs(cfg: TrainerConfig, rows: int, row_len: int, sharding: Any, model_cfg: Any) -> dict[str, Any]:
    """ShapeDtypeStructs of one placed micro-step of `rows` rows of `row_len` positions (`batch_fields`): [rows,
    row_len] each, the sampler's routes [rows, row_len, L_moe, k] (train.router_replay)."""
    out = {}
    for k in batch_fields(cfg):
        shape: tuple[int, ...] = (rows, row_len)
        if k == "routes":
            shape += (moe_layer_count(model_cfg), model_cfg.num_experts_per_tok)
        out[k] = jax.ShapeDtypeStruct(shape, jnp.int32 if k in INT_FIELDS else jnp.float32, sharding=sharding)
    return out


def abstract(tree: Any, shardings: Any = None) -> Any:
    """ShapeDtypeStructs of `tree`'s leaves laid out by `shardings` (same structure; default each leaf's own
    .sharding), to lower programs with."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def accumulator_specs(train: Any) -> Any:
    """ShapeDtypeStructs of the gradient accumulators of `train` (arrays or ShapeDtypeStructs with shardings):
    float32 at least, sharded like the params."""
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.promote_types(p.dtype, jnp.float32),
                                                       sharding=p.sharding), train)


def extended_to_depth(at: Callable[[int], int | None], layers: int, base: int) -> int | None:
    """A program's working memory at `layers` layers from its copies at `base` and `base` + 1 layers (`at(n)`:
    the n-layer copy's bytes, None without a memory analysis), the difference extended to every layer; the
    program itself when the model is that shallow. Two small compiles."""
    if layers <= base + 1:
        return at(layers)
    shallow = at(base)
    deeper = None if shallow is None else at(base + 1)
    if shallow is None or deeper is None:
        return None
    return max(shallow, shallow + (layers - base) * (deeper - shallow))


KINDS = ("attention", "linear", "model")  # a probe's layers: all attention; all Gated DeltaNet; the model's own


def probe_config(model_cfg: ModelConfig, layers: int, kind: str) -> ModelConfig:
    """The config a memory probe compiles: `layers` layers of one `KINDS` kind, or the model itself ("model", at its
    own depth)."""
    if kind not in KINDS or kind == "model" and layers != model_cfg.num_layers:
        raise ValueError(f"kind must be one of {KINDS} (model: at its own {model_cfg.num_layers} layers), got "
                         f"{kind!r} at {layers} layers.")
    return model_cfg if kind == "model" else model_cfg.with_layers(layers, linear=kind == "linear")


def layer_counts(model_cfg: ModelConfig) -> dict[str, int]:
    """{kind: layers} of the kinds `model_cfg` has: "attention" (sliding or full) and "linear" (a stateful mixer:
    Gated DeltaNet, a short convolution, Mamba-2; with attention beside it in a hybrid layer, Falcon-H1's)."""
    linear = sum(model_cfg.layer_is_linear(i) or model_cfg.layer_is_hybrid(i) for i in range(model_cfg.num_layers))
    return {k: n for k, n in (("attention", model_cfg.num_layers - linear), ("linear", linear)) if n}


def extended_by_kind(at: Callable[[int, str], int | None], model_cfg: ModelConfig, base: int) -> int | None:
    """`extended_to_depth` for a model whose layers differ in kind (`layer_counts`; at(n, kind): the bytes of an
    n-layer copy of that kind alone). A hybrid's layers (Qwen3.5: three Gated DeltaNet layers to one of attention)
    each add their own kind's step; the part that does not grow with depth is the larger of the kinds'. Two small
    compiles per kind."""
    counts = layer_counts(model_cfg)
    if len(counts) == 1:
        kind, n = next(iter(counts.items()))
        return extended_to_depth(lambda layers: at(layers, kind), n, base)
    shallow_max, fixed, grown = 0, 0, 0
    for kind, n in counts.items():
        shallow = at(base, kind)
        deeper = None if shallow is None else at(base + 1, kind)
        if deeper is None:
            return None
        step = deeper - shallow
        shallow_max, fixed, grown = max(shallow_max, shallow), max(fixed, shallow - base * step), grown + n * step
    return max(shallow_max, fixed + grown)


def update_temp_bytes(build: ModelBuilder, model_cfg: ModelConfig, cfg: TrainerConfig, mesh: Mesh, *,
                      layers: int, tokens: int | None = None, wrt: Any = nnx.Param,
                      program: str = "accumulate", kind: str = "attention") -> int | None:
    """XLA's working memory (bytes per device) of one micro-step of the update for a `layers`-layer copy
    of the model, at one packed row of `tokens` (default micro_batch_tokens) per data device; with
    program="apply", of the optimizer step instead (gradient clipping and AdamW: about 1.5x the trained
    params on the CPU, which can exceed a small micro-step's).

    build(model_cfg) makes the model (with adapters, for LoRA); it runs under nnx.eval_shape, so no
    parameter is allocated. Compiles one small program. remat "auto" is measured as "none". None where the
    backend gives no memory analysis. kind: the copy's layers (`KINDS`): all full attention, all Gated DeltaNet,
    or the model's own (then `layers` is its depth)."""
    small = probe_config(model_cfg, layers, kind)
    if cfg.remat == "auto":
        cfg = dataclasses.replace(cfg, remat="none")
    graphdef, params, other = nnx.split(nnx.eval_shape(lambda: build(small)), wrt, ...)
    head = None
    if cfg.critic == "value_head":
        head = jax.eval_shape(lambda: init_value_head(small.hidden_size))
    tx = make_optimizer(cfg, 1)
    shardings = train_state_shardings(params, tx, mesh, head)
    other_sharding = logical_to_mesh_sharding(other, mesh)
    fns = build_update_fns(graphdef, cfg, tx, make_schedule(cfg, 1), shardings, other_sharding, mesh, model_cfg=small)
    train = (params, head) if head is not None else params
    train_in = abstract(train, shardings.trainable())
    grads = accumulator_specs(train_in)
    rep = NamedSharding(mesh, PartitionSpec())
    sums = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), jax.eval_shape(fns.zero_metrics))
    batch = batch_structs(cfg, int(mesh.shape["fsdp"]), int(tokens or cfg.micro_batch_tokens), fns.batch_sharding,
                          small)
    version = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    if program == "apply":
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        opt = abstract(jax.eval_shape(tx.init, train), shardings.opt_state)
        state = TrainState(params=abstract(params, shardings.params), opt_state=opt, step=scalar, version=scalar,
                           skipped_updates=scalar, value_head=None if head is None else abstract(head, shardings.value_head))
        loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
        compiled = fns.apply.lower(state, grads, sums, loss, scalar).compile()
    else:
        compiled = fns.accumulate.lower(train_in, abstract(other, other_sharding), grads, sums, batch,
                                        version).compile()
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def program_bytes(build: ModelBuilder, model_cfg: ModelConfig, cfg: TrainerConfig, mesh: Mesh, program: str, *,
                  tokens: int | None = None, wrt: Any = nnx.Param) -> int | None:
    """XLA's working memory (bytes per device) of the full-depth `program` ("accumulate": one micro-step;
    "apply": the optimizer step), from its 1- and 2-layer copies (2- and 3-layer for the optimizer step, whose
    buffers settle into their per-layer growth from the second layer on, and with train.scan_layers, since
    a scan needs two layers), per kind of layer (`extended_by_kind`); the program itself when the model is that
    shallow. None where the backend gives no memory analysis. Two small compiles (four for a hybrid model)."""
    base = 2 if cfg.scan_layers or program == "apply" else 1
    return extended_by_kind(lambda layers, kind: update_temp_bytes(build, model_cfg, cfg, mesh, layers=layers,
                                                                   tokens=tokens, wrt=wrt, program=program, kind=kind),
                            model_cfg, base)


def activation_bytes(build: ModelBuilder, model_cfg: ModelConfig, cfg: TrainerConfig, mesh: Mesh, *,
                     tokens: int | None = None, wrt: Any = nnx.Param) -> int | None:
    """XLA's working memory (bytes per device) of the full-depth update: the larger of one micro-step's and
    the optimizer step's (`program_bytes`; they never run at once); None where the backend gives no memory
    analysis. Four small compiles."""
    need = [program_bytes(build, model_cfg, cfg, mesh, p, tokens=tokens, wrt=wrt) for p in ("accumulate", "apply")]
    return None if None in need else max(need)


def choose_remat(build: ModelBuilder, model_cfg: ModelConfig, cfg: TrainerConfig, mesh: Mesh, *,
                 held_bytes: int, device_bytes: int | None, headroom: float = 0.9,
                 wrt: Any = nnx.Param) -> tuple[str, int | None]:
    """(remat, activation bytes) for `cfg.remat`: "auto" becomes the first of none, dots, full whose
    update fits `headroom` x device_bytes beside `held_bytes` (params, optimizer state, gradients and
    whatever else lives on the device), else "full"; any other choice stays. Without a device limit
    (the CPU) "auto" is "none" and nothing is measured (None)."""
    if cfg.remat != "auto":
        if device_bytes is None:
            return cfg.remat, None
        return cfg.remat, activation_bytes(build, model_cfg, cfg, mesh, wrt=wrt)
    if device_bytes is None:
        return "none", None
    step = program_bytes(build, model_cfg, cfg, mesh, "apply", wrt=wrt)  # the optimizer step: remat-independent
    need = None
    for choice in REMAT_ORDER:
        micro = program_bytes(build, model_cfg, dataclasses.replace(cfg, remat=choice), mesh, "accumulate", wrt=wrt)
        if micro is None or step is None:  # no memory analysis from this backend: nothing to choose by
            return "none", None
        need = max(micro, step)
        if held_bytes + need <= headroom * device_bytes:
            return choice, need
    return "full", need
