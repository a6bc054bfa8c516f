"""The job's device memory plan: what each part holds per device, checked before weights load or compile.

A model that does not fit used to fail deep inside XLA (an allocation of tens of GiB in the update's
program, minutes after start) with an error that names no config key. The job now adds up, per device
and from shapes alone, what stays resident (`state_parts`): the trainer's params, AdamW moments and
gradient accumulators, frozen and reference weights, the sampler's copy of the weights (and the next version's,
which exists beside it during a hand-off) and its KV cache (with the standby rows and the decode logits), and what an evaluation adds while it runs (a weights copy
and its engine's caches). Train parts sit on the train devices, rollout parts on the rollout devices, both
on the same devices when colocated; the plan is the most loaded device. The update and an evaluation
never run at once, so only the larger of the two counts.
On a device that reports its memory (GPUs, TPUs) the resident parts are checked before anything is
loaded; the update's working memory (`trainer.memory`, measured by XLA on 1- and 2-layer programs) is
added once the trainer has chosen `train.remat`, then the working memory of the sampler's programs (a
decode dispatch, the longest prefill; `sampler.memory`, measured the same way) and of an evaluation
stream's, each checked before any full-depth program compiles.
A plan that does not fit raises a ConfigError naming every part, the largest one that a config key
shrinks, and that key.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.knobs import ConfigError
from areal_jax.models.config import ModelConfig
from areal_jax.models.expert_parallel import expert_shards
from areal_jax.models.sharding import logical_to_mesh_sharding
from areal_jax.system.rollout_memory import (  # noqa: F401 (kv_position_bytes: part of this module's API)
    eval_bytes,
    eval_rollout,
    kv_cache_bytes,
    kv_position_bytes,
    pool_pages,
    sampler_weight_parts,
)
from areal_jax.trainer.memory import per_device_bytes

GiB = 2**30
HEADROOM = 0.9  # of the device's memory; the rest for XLA's own scratch, fragmentation and small buffers
# The update and an evaluation run on the same thread, one after the other: only the larger of the two counts.
EXCLUSIVE = ("update_activations", "evaluation")
HINTS = {
    "params": "shard the trainer over more devices (--config.mesh.fsdp / mesh.train_devices) or use LoRA "
              "(--config.lora.enabled=True)",
    "optimizer": "store AdamW's moments in bfloat16 (--config.train.moment_dtype=bfloat16: half the bytes), shard "
                 "the trainer over more devices (--config.mesh.fsdp) or use LoRA (--config.lora.enabled=True): AdamW "
                 "keeps two moments of every trained parameter",
    "gradients": "shard the trainer over more devices (--config.mesh.fsdp) or use LoRA (--config.lora.enabled=True)",
    "frozen_weights": "store the frozen base in bfloat16 (--config.lora.base_dtype=bfloat16)",
    "reference": "set --config.train.kl_coef=0 (the KL penalty keeps a second copy of the weights)",
    "sampler_params": "set --config.rollout.param_dtype=bfloat16 or give the sampler more devices "
                      "(--config.mesh.rollout_devices)",
    "lora_base": "set --config.lora.sampler=unmerged (the sampler then decodes the base and the adapters as they are, "
                 "with no merged copy) or store the base in bfloat16 (--config.lora.base_dtype=bfloat16)",
    "handoff": "set --config.rollout.param_dtype=bfloat16 or give the sampler more devices "
               "(--config.mesh.rollout_devices): each new version's weights exist beside the sampler's current ones "
               "until it swaps them at its next dispatch",
    "kv_cache": "lower --config.rollout.num_slots or rollout.max_len, or use --config.rollout.kv_cache=paged with "
                "fewer --config.rollout.kv_pages",
    "update_activations": "set --config.train.remat=full (or dots), or lower --config.train.micro_batch_tokens / "
                          "train.logits_chunk (the optimizer step's share shrinks with --config.mesh.fsdp or LoRA)",
    "sampler_programs": "lower --config.rollout.num_slots or rollout.decode_steps (a decode dispatch's working memory "
                        "grows with the slots), or rollout.max_len (the longest prefill: after a weight update "
                        "--config.rollout.on_update=recompute re-prefills in-flight sequences up to max_len; "
                        "on_update=continue keeps their caches)",
    "evaluation": "lower --config.eval.num_slots or eval.max_new_tokens (an evaluation adds its own weights copy and "
                  "KV cache while it runs)",
}


@dataclasses.dataclass
class MemoryPlan:
    """Bytes per part on the most loaded device, and that device's memory (None: not reported)."""

    parts: dict[str, int]
    device_bytes: int | None
    hints: dict[str, str] = dataclasses.field(default_factory=dict)  # replaces HINTS[part] where given

    @property
    def total(self) -> int:
        """Peak bytes: every part, but only the larger of the update's working memory and an evaluation's."""
        rest = sum(v for k, v in self.parts.items() if k not in EXCLUSIVE)
        return int(rest + max((self.parts.get(k, 0) for k in EXCLUSIVE), default=0))

    def describe(self) -> str:
        unit, size = ("GiB", GiB) if self.total >= GiB else ("MiB", 2**20)
        listing = ", ".join(f"{k} {v / size:.2f}" for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1]) if v)
        of = f" of {self.device_bytes / GiB:.1f} GiB" if self.device_bytes else " (the device reports no limit)"
        both = all(self.parts.get(k) for k in EXCLUSIVE)
        note = " (the update and an evaluation never run at once: the larger counts)" if both else ""
        return f"{self.total / size:.2f} {unit} per device{of}: {listing} {unit}{note}"

    def check(self, headroom: float = HEADROOM) -> None:
        """Raise ConfigError when the parts exceed `headroom` of the device's memory."""
        if not self.device_bytes or self.total <= headroom * self.device_bytes:
            return
        hints = {**HINTS, **self.hints}
        largest = max((k for k in self.parts if k in hints), key=lambda k: self.parts[k])
        raise ConfigError(
            f"This run does not fit its devices: it needs {self.describe()}, more than {headroom:.0%} of the "
            f"device's {self.device_bytes / GiB:.1f} GiB. The largest part is {largest}: {hints[largest]}.")


def expert_parallel_on(cfg: ModelConfig, mesh: Any) -> bool:
    """Whether `cfg`'s experts train expert-parallel on train mesh `mesh` (models.expert_parallel)."""
    fsdp = int(dict(mesh.shape).get("fsdp", 1))
    return bool(cfg.num_experts) and expert_shards(cfg.num_experts, fsdp, cfg.expert_parallel) > 1


def state_parts(job: Any, cfg: ModelConfig, meshes: Any, build: Callable[[ModelConfig], nnx.Module],
                wrt: Any = nnx.Param) -> tuple[dict[str, int], dict[str, int]]:
    """(train parts on one train device, rollout parts on one rollout device), bytes, from shapes.

    job: the JobConfig; cfg: the model's config (storage and compute dtypes set); build(cfg) makes the
    model as the job trains it (adapters included), run under nnx.eval_shape."""
    from areal_jax.trainer.optim import make_optimizer
    from areal_jax.trainer.state import train_state_shardings

    mesh = meshes.train_mesh
    _, params, other = nnx.split(nnx.eval_shape(lambda: build(cfg)), wrt, ...)
    p_shard, o_shard = logical_to_mesh_sharding(params, mesh), logical_to_mesh_sharding(other, mesh)
    trained, frozen = per_device_bytes(params, p_shard), per_device_bytes(other, o_shard)
    tx = make_optimizer(job.train, 1)
    box = {}

    def moment_shardings(p: Any) -> int:  # traced, so optax's own init of stand-in params compiles nothing
        box["shardings"] = train_state_shardings(p, tx, mesh).opt_state
        return 0

    jax.eval_shape(moment_shardings, params)
    moments = per_device_bytes(jax.eval_shape(tx.init, params), box["shardings"])
    grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.promote_types(x.dtype, jnp.float32)), params)
    train = {"params": trained, "optimizer": moments, "gradients": per_device_bytes(grads, p_shard),
             "frozen_weights": frozen, "reference": trained + frozen if job.train.kl_coef > 0 else 0}
    r, rmesh = job.rollout.for_prompts(job.data.max_prompt_len), meshes.rollout_mesh
    tensor = int(rmesh.shape.get("tensor", 1))
    train_copy, rollout = sampler_weight_parts(job, nnx.state(nnx.eval_shape(lambda: build(cfg))), mesh, rmesh)
    train.update(train_copy)
    rollout.update(kv_cache=kv_cache_bytes(cfg, r, tensor),
                   evaluation=eval_bytes(job, cfg, tensor, rollout["sampler_params"], jax.default_backend()))
    return train, rollout


def plan(train: dict[str, int], rollout: dict[str, int], colocated: bool,
         device_bytes: int | None, hints: dict[str, str] | None = None) -> MemoryPlan:
    """The plan of the most loaded device: both sides summed when colocated, else the larger side."""
    if colocated:
        return MemoryPlan({**train, **rollout}, device_bytes, dict(hints or {}))
    sides = (MemoryPlan(dict(train), device_bytes, dict(hints or {})),
             MemoryPlan(dict(rollout), device_bytes, dict(hints or {})))
    return max(sides, key=lambda p: p.total)


def model_builder(lora: Any, seed: int) -> Callable[[ModelConfig], nnx.Module]:
    """build(cfg): the model as the job trains it (a Transformer, with LoRA adapters when `lora` is set)."""
    from areal_jax.models import Transformer

    def build(cfg: ModelConfig) -> nnx.Module:
        model = Transformer(cfg, rngs=nnx.Rngs(seed))
        if lora is None:
            return model
        from areal_jax.models.lora import apply_lora

        return apply_lora(model, lora, rngs=nnx.Rngs(seed))

    return build


@dataclasses.dataclass
class JobMemory:
    """The job's resident parts (`JobMemory.prepare`, before the weights load), then the update's working memory
    (`resolve_update`, before the trainer exists)."""

    train: dict[str, int]  # on one train device
    rollout: dict[str, int]  # on one rollout device
    colocated: bool
    device_bytes: int | None
    model: ModelConfig
    build: Callable[[ModelConfig], nnx.Module]
    wrt: Any
    tensor: int = 1  # the rollout mesh's tensor axis (the KV cache splits its kv heads over it)
    hints: dict[str, str] = dataclasses.field(default_factory=dict)  # what the run already tried, per part
    log: Callable[[str], None] | None = None  # progress lines while programs are measured

    @property
    def n_params(self) -> int:
        """Parameters of the model (adapters included)."""
        return int(sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: self.build(self.model))))))

    @property
    def plan(self) -> MemoryPlan:
        return plan(self.train, self.rollout, self.colocated, self.device_bytes, self.hints)

    @classmethod
    def for_job(cls, job: Any, cfg: ModelConfig, meshes: Any, log: Callable[[str], None] | None = None) -> "JobMemory":
        """`prepare` against mesh.device_memory_gib, or the smallest limit the devices of any process report
        (`runtime.multihost.agreed_limit`: every process of a run plans against the same limit)."""
        from areal_jax.runtime.multihost import agreed_limit
        from areal_jax.trainer.memory import device_memory_bytes

        limit = device_memory_bytes(job.mesh.device_memory_gib)
        out = cls.prepare(job, cfg, meshes, limit if job.mesh.device_memory_gib is not None else agreed_limit(limit))
        out.log = log
        return out

    @classmethod
    def prepare(cls, job: Any, cfg: ModelConfig, meshes: Any, device_bytes: int | None) -> "JobMemory":
        """The resident parts, checked (ConfigError) when the device reports its memory."""
        lora = job.lora if job.lora.enabled else None
        wrt = nnx.Param if lora is None else nnx.LoRAParam
        build = model_builder(lora, job.seed)
        train, rollout = state_parts(job, cfg, meshes, build, wrt)
        out = cls(train, rollout, meshes.colocated, device_bytes, cfg, build, wrt,
                  int(meshes.rollout_mesh.shape.get("tensor", 1)))
        out.plan.check()
        return out

    def fill_pages(self, rollout: Any) -> Any:
        """The rollout config with kv_pages=-1 resolved: as many pages as `HEADROOM` of a rollout device holds
        beside every other part of the plan (call after `resolve_update`, which adds the update's memory), or
        the default pool (None) where the device reports no limit. Other settings are returned unchanged."""
        if rollout.kv_cache != "paged" or rollout.kv_pages != -1:
            return rollout
        if self.device_bytes is None:
            return dataclasses.replace(rollout, kv_pages=None)
        on_device = MemoryPlan({**self.train, **self.rollout} if self.colocated else dict(self.rollout),
                               self.device_bytes)
        least = self.rollout["kv_cache"]  # the plan so far holds a one-sequence pool
        page = (kv_cache_bytes(self.model, dataclasses.replace(rollout, kv_pages=pool_pages(rollout) + 1),
                               self.tensor) - least)
        free = HEADROOM * self.device_bytes - (on_device.total - least)
        pages = max(pool_pages(rollout), int((free - (least - pool_pages(rollout) * page)) // page))
        filled = dataclasses.replace(rollout, kv_pages=pages)
        self.rollout["kv_cache"] = kv_cache_bytes(self.model, filled, self.tensor)
        self.plan.check()
        return filled

    def add_sampler(self, job: Any, mesh: Any) -> None:
        """Add the working memory of the sampler's programs (`sampler.memory`: the larger of a decode dispatch and
        the longest prefill, measured by XLA on 3- and 4-layer programs) to the rollout parts, and that of an
        evaluation stream's programs (times the streams) to the evaluation part, then check the plan, on devices
        with a memory limit; where the device reports none, nothing is compiled."""
        if self.device_bytes is None:
            return
        from areal_jax.sampler.memory import sampler_bytes

        need = sampler_bytes(job.rollout.for_prompts(job.data.max_prompt_len), self.model, mesh,
                             max_prompt_len=job.data.max_prompt_len)
        if need is None:
            return
        self.rollout["sampler_programs"] = max(need.values())
        backend = jax.default_backend()
        ev = eval_rollout(job, backend)
        if ev is not None and self.rollout.get("evaluation"):
            programs = sampler_bytes(ev, self.model, mesh, max_prompt_len=job.data.max_prompt_len)
            self.rollout["evaluation"] += job.eval.streams_for(backend) * max(programs.values())
        self.plan.check()

    def resolve_rollout(self, job: Any, mesh: Any) -> Any:
        """`add_sampler`, then `fill_pages`: job.rollout with kv_pages=-1 resolved after every other part (and
        standby_len for data.max_prompt_len, `RolloutConfig.for_prompts`)."""
        self.add_sampler(job, mesh)
        return self.fill_pages(job.rollout.for_prompts(job.data.max_prompt_len))

    def resolve_update(self, cfg: Any, mesh: Any) -> Any:
        """The trainer config with train.remat resolved, after adding the update's working memory to the plan
        and checking it, on devices with a memory limit (trainer.memory.choose_remat: "auto" becomes the least
        recomputation that fits beside every resident part). Without a limit, "auto" is "none". A mixture of
        experts with model.expert_dispatch "auto" that trains expert-parallel takes the ring where only it fits, or
        fits with less recomputation (`self.model` then says "ring"); else the all-gather."""
        from areal_jax.trainer.memory import REMAT_ORDER, choose_remat

        if self.device_bytes is not None and self.log is not None:
            self.log("Device memory: measuring the working memory of the update's, the sampler's and the "
                     "evaluation's programs (XLA's analysis of small abstract programs; seconds to a minute) ...")
        on_train = {**self.train, **(self.rollout if self.colocated else {})}
        held = sum(v for k, v in on_train.items() if k not in EXCLUSIVE)  # an evaluation never runs beside it
        auto = self.model.expert_dispatch == "auto"
        if auto:
            self.model = self.model.replace(expert_dispatch="gather")
        remat, act = choose_remat(self.build, self.model, cfg, mesh, held_bytes=held, device_bytes=self.device_bytes,
                                  headroom=HEADROOM, wrt=self.wrt)
        tried = False  # both dispatches measured
        if auto and act is not None and expert_parallel_on(self.model, mesh):
            def rank(r: str, need: int) -> tuple[bool, int]:  # fits first, then the least recomputation
                return held + need > HEADROOM * self.device_bytes, REMAT_ORDER.index(r) if r in REMAT_ORDER else 9

            if rank(remat, act) != (False, 0):  # the all-gather fits only with recomputation, or not at all
                ring, tried = self.model.replace(expert_dispatch="ring"), True
                ring_remat, ring_act = choose_remat(self.build, ring, cfg, mesh, held_bytes=held,
                                                    device_bytes=self.device_bytes, headroom=HEADROOM, wrt=self.wrt)
                if ring_act is not None and rank(ring_remat, ring_act) < rank(remat, act):
                    if self.log is not None:
                        self.log(f"Device memory: model.expert_dispatch=auto takes the ring: the update needs "
                                 f"{ring_act / 2**30:.2f} GiB with train.remat={ring_remat} against the all-gather's "
                                 f"{act / 2**30:.2f} GiB with {remat}")
                    self.model, remat, act = ring, ring_remat, ring_act
        if act is not None:
            self.train["update_activations"] = int(act)
        if remat == "full":  # nothing left to recompute: the micro-step itself must shrink
            self.hints["update_activations"] = (
                "even with train.remat=full, lower --config.train.micro_batch_tokens or train.logits_chunk, or shard "
                "the trainer over more devices (--config.mesh.fsdp)")
        if expert_parallel_on(self.model, mesh):
            held_pairs = ("whose buffers hold the pairs of the micro-batch's tokens over every device: "
                          "--config.model.expert_dispatch=ring holds one device's at a time, "
                          if self.model.expert_dispatch == "gather" and not tried
                          else "by gather or ring (both measured): " if tried
                          else "over the ring (one device's tokens at a time): ")
            self.hints["update_activations"] = self.hints.get("update_activations", HINTS["update_activations"]) + (
                f"; this mixture of experts trains expert-parallel, {held_pairs}--config.model.expert_parallel=false "
                "gathers the experts instead")
        self.plan.check()
        return dataclasses.replace(cfg, remat=remat)
