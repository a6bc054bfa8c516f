"""Trainer: the sharded PPO update on the train mesh (imperative shell around trainer.update)."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models import FlatParams, logical_to_mesh_sharding
from areal_jax.models.config import model_config_of
from areal_jax.trainer import batch as batching
from areal_jax.trainer import layout, memory
from areal_jax.trainer import update as update_lib
from areal_jax.trainer.batch import Trajectory
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.logprobs import init_value_head
from areal_jax.trainer.optim import make_optimizer, make_schedule
from areal_jax.trainer.publish import SamplerCopy
from areal_jax.trainer.state import TrainState, copy_to, create_train_state, put_global, replicated
from areal_jax.trainer.update import CRITIC_FIELDS, LOSS_FIELDS, UpdateFns, build_update_fns, model_fields

_FNS_CACHE: "OrderedDict[tuple, UpdateFns]" = OrderedDict()
_FNS_CACHE_SIZE = 8


class Trainer:
    """Runs PPO updates of `model` on `mesh` (axes "fsdp", "tensor").

    Args:
      model: the policy (an nnx.Module following the areal_jax.models contract); its params are
        copied onto the mesh, the module itself is not modified afterwards.
      cfg: TrainerConfig.
      mesh: the train mesh; each micro-step feeds one packed row to every "fsdp" position.
      ref_model: reference policy for the KL penalty (required when cfg.kl_coef > 0); its params
        live on the train mesh with the same shardings as the policy's.
      wrt: filter of the trained variables (default every nnx.Param; nnx.LoRAParam trains only LoRA
        adapters, models.lora). The rest is frozen and kept on the mesh by its logical axes.
      schedule_steps: optimizer steps the learning-rate schedule spans (a job: total_steps x
        train.ppo_minibatches).
      max_staleness: drop tokens produced more than this many versions before the trainer's version
        (a job: rollout.max_staleness; None keeps every token).

    cfg.remat="auto" is resolved here against the trainer's own memory (trainer.memory.choose_remat);
    a job resolves it first, against everything its devices hold (system.memory).

    With several processes every process calls `update` with the same trajectories (one SPMD
    program over the global train mesh).
    """

    def __init__(self, model: nnx.Module, cfg: TrainerConfig, mesh: Mesh, *, ref_model: nnx.Module | None = None,
                 wrt: Any = nnx.Param, schedule_steps: int = 1000, max_staleness: int | None = None):
        if tuple(mesh.axis_names) != ("fsdp", "tensor"):
            raise ValueError(
                f"The train mesh must have axes ('fsdp', 'tensor'), got {tuple(mesh.axis_names)}; build it "
                "with areal_jax.runtime.mesh.build_meshes."
            )
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs a reference model: pass ref_model=..., or set kl_coef=0.")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0 (or None to keep every token).")
        self.cfg = cfg
        self.max_staleness = max_staleness
        self.mesh = mesh
        self.n_devices = int(mesh.shape["fsdp"])
        self._wrt = wrt
        self._graphdef, params, other = nnx.split(model, wrt, ...)
        self._model_cfg = model_config_of(model, required=False)
        if not jax.tree.leaves(params):
            raise ValueError(f"The model has no variables of {wrt} to train; apply LoRA adapters first "
                             "(models.lora.apply_lora) or train every nnx.Param.")
        self._has_other = bool(jax.tree.leaves(other))
        self._attention_weight = _attention_weight(model, params, other)
        # The micro-step shapes packed so far (what this trainer has compiled); checkpoint_meta() / restore() carry it.
        self.layouts = layout.ShapeBook(cfg.new_shape_cost)
        self._packed = np.zeros(2, np.int64)
        self._tx = make_optimizer(cfg, schedule_steps)
        self._schedule = make_schedule(cfg, schedule_steps)
        value_head = None
        if cfg.critic == "value_head":
            value_head = init_value_head(int(nnx.merge(self._graphdef, params, other).unembed_matrix().shape[0]))
        self.state, self._shardings = create_train_state(params, self._tx, mesh, value_head=value_head)
        self._other_sharding = logical_to_mesh_sharding(other, mesh)  # frozen weights shard like params
        self._other = copy_to(other, self._other_sharding)
        self._ref = None
        if ref_model is not None:
            ref_graphdef, ref_params, ref_other = nnx.split(ref_model, wrt, ...)
            if ref_graphdef != self._graphdef or jax.tree.structure(ref_params) != jax.tree.structure(params):
                raise ValueError("ref_model must have the same architecture (module graph and parameters) as the model.")
            self._ref = (copy_to(ref_params, self._shardings.params), copy_to(ref_other, self._other_sharding))
        # train.remat "auto" resolved; measuring it on a device that reports its memory gives XLA's working
        # memory of one micro-step (trainer.memory), else None.
        remat, self.activation_bytes = self._choose_remat(model)
        self.cfg = cfg = dataclasses.replace(cfg, remat=remat)
        self._fns = self._compiled_fns(other)
        self._copy: SamplerCopy | None = None  # keep_sampler_copy

    def held_bytes(self) -> int:
        """Bytes the trainer holds on each train device between updates (params, optimizer state, frozen
        and reference weights), plus the gradient accumulators an update adds."""
        grads = memory.accumulator_specs(self.state.trainable())
        return memory.per_device_bytes((self.state, self._other, self._ref, grads))

    def _choose_remat(self, model: nnx.Module) -> tuple[str, int | None]:
        if self.cfg.remat != "auto":
            return self.cfg.remat, None
        device_bytes = memory.device_memory_bytes(devices=self.mesh.local_devices)
        if device_bytes is None:  # a CPU: no limit to fit, and remat saves nothing there (trainer.memory)
            return "none", None
        from areal_jax.models import Transformer

        # The probe models are plain Transformers with every nnx.Param trained: the same activations as
        # adapters over the same layers.
        return memory.choose_remat(lambda c: Transformer(c, rngs=nnx.Rngs(0)), model_config_of(model), self.cfg,
                                   self.mesh, held_bytes=self.held_bytes(), device_bytes=device_bytes)

    def _compiled_fns(self, other: nnx.State):
        """The jitted update pieces, shared by Trainers of the same model graph, config and mesh (the
        graph fixes the param shapes and hence the shardings), so a second Trainer compiles nothing."""
        key = (self._graphdef, self.cfg, self.mesh, jax.tree.structure(other), self._wrt)
        fns = _FNS_CACHE.pop(key, None)
        if fns is None:
            fns = build_update_fns(self._graphdef, self.cfg, self._tx, self._schedule, self._shardings,
                                   self._other_sharding, self.mesh, model_cfg=self._model_cfg)
        _FNS_CACHE[key] = fns
        while len(_FNS_CACHE) > _FNS_CACHE_SIZE:
            _FNS_CACHE.popitem(last=False)
        return fns

    def warm_up(self, longest: int, background: bool = False, log=None):
        """Compile the update's programs for the shape of rows holding `longest` packed tokens, as many as
        micro_batch_tokens holds, and record it in `layouts`; in a daemon thread (returned) when background
        (trainer.warmup)."""
        from areal_jax.trainer.warmup import warm_up

        return warm_up(self, longest, background=background, log=log)

    # ------------------------------------------------------------------ accessors
    @property
    def params(self) -> nnx.State:
        """Current params on the train mesh (pytree structure of `nnx.split(model)[1]`)."""
        if self._has_other:
            return nnx.merge_state(self.state.params, self._other)
        return self.state.params

    def keep_sampler_copy(self, dtype: Any, shardings: Any = None) -> None:
        """From now on the optimizer step that ends each update also writes the new params cast to `dtype`
        (None: their own dtype), fused into the step, for `sampler_copy()`; `shardings` (one per leaf of `params`,
        on the train devices) lays the copy out as the sampler wants it (trainer.publish.SamplerCopy)."""
        self._copy = SamplerCopy(dtype, self.state.params, self._other, shardings)

    @property
    def keeps_sampler_copy(self) -> bool:
        return self._copy is not None

    def sampler_copy(self) -> FlatParams:
        """The current params (with the frozen variables, like `params`) in keep_sampler_copy's dtype, held flat
        in fresh buffers that no update donates: the copy the last update wrote (the first call after the update
        takes it; the trainer keeps no reference), else one cast now."""
        if self._copy is None:
            raise ValueError("sampler_copy() needs keep_sampler_copy(dtype) first.")
        return self._copy.take(self.version, self.state.params)

    @property
    def version(self) -> int:
        return int(jax.device_get(self.state.version))

    @property
    def graphdef(self) -> nnx.GraphDef:
        return self._graphdef

    def checkpoint_meta(self) -> dict:
        """JSON a checkpoint keeps beside `state` so that restore() resumes bit for bit: the book of compiled shapes
        (a resumed trainer packs its micro-steps as the one it continues)."""
        return {"layouts": self.layouts.state()}

    def restore(self, state: TrainState, meta: dict | None) -> None:
        """Continue from a checkpoint: its `state` and the meta saved with it (holding checkpoint_meta(); None, or a
        meta from before the book existed: the book starts empty)."""
        self.state = state
        if self._copy is not None:
            self._copy.forget()
        self.layouts.load_state((meta or {}).get("layouts"))

    # ------------------------------------------------------------------ helpers
    def _place(self, step: dict[str, np.ndarray], fields: Sequence[str]) -> dict[str, jax.Array]:
        return put_global({k: step[k] for k in fields}, self._fns.batch_sharding)

    def _steps(self, trajs, indices, masks, weights, version):
        if self.cfg.router_replay != "off":
            batching.check_routes(trajs, self._model_cfg, f"train.router_replay={self.cfg.router_replay}")
        steps = batching.pack_steps(
            trajs, indices, masks, weights, n_devices=self.n_devices,
            micro_batch_tokens=self.cfg.micro_batch_tokens, trainer_version=version,
            attention_weight=self._attention_weight, step_overhead=self.cfg.micro_step_overhead, book=self.layouts,
        )
        for step in steps:  # tokens and positions packed, for the update's packed_fraction
            self._packed += (int(np.count_nonzero(step["segment_ids"])), step["segment_ids"].size)
        return steps

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[np.ndarray]:
        """Log-probs of each trajectory's completion tokens under the current params.

        Returns one float32 [L - prompt_len] array per trajectory.
        """
        trajs = list(trajectories)
        if not trajs:
            return []
        masks = [np.ones(t.completion_len, np.float32) for t in trajs]
        out = [np.zeros(t.completion_len, np.float32) for t in trajs]
        for step in self._steps(trajs, range(len(trajs)), masks, None, 0):
            logp = self._fns.forward(self.state.trainable(), self._other, self._place(step, model_fields(self.cfg)))
            _scatter(out, _fetch(logp[0] if self._critic else logp), step)
        return out

    @property
    def _critic(self) -> bool:
        return self.state.value_head is not None

    def critic_targets(self, trajectories: Sequence[Trajectory]) -> tuple[list[np.ndarray], ...]:
        """What the next update trains the critic and policy on (train.critic=value_head): per
        trajectory (values, advantages, returns), float32 [L - prompt_len] each, from the current params
        and value head (batching.gae_targets over the staleness-filtered masks; the advantages whitened
        over the batch with cfg.whiten_advantages)."""
        if not self._critic:
            raise ValueError("critic_targets needs a value head: set --config.train.critic=value_head.")
        trajs = list(trajectories)
        masks, _ = batching.effective_masks(trajs, self.version, self.max_staleness)
        steps = self._steps(trajs, range(len(trajs)), masks, None, self.version)
        values, _ = self._values(trajs, steps)
        return (values, *self._gae(trajs, masks, values))

    def _gae(self, trajs, masks, values) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(advantages as the policy loss takes them, returns) from GAE, whitened per cfg."""
        advantages, returns = batching.gae_targets(trajs, masks, values, gamma=self.cfg.gamma, lam=self.cfg.lam)
        if self.cfg.whiten_advantages:
            advantages = batching.whiten(advantages, masks)
        return advantages, returns

    def _values(self, trajs, steps) -> tuple[list[np.ndarray], list[jax.Array]]:
        """Per-trajectory values at the completion tokens and each step's (placed) log-probs, from one
        forward pass of the current params and value head over the packed steps."""
        values = [np.zeros(t.completion_len, np.float32) for t in trajs]
        logps = []
        for step in steps:
            logp, v = self._fns.forward(self.state.trainable(), self._other, self._place(step, model_fields(self.cfg)))
            _scatter(values, _fetch(v), step)
            logps.append(logp)
        return values, logps

    # ------------------------------------------------------------------ the update
    def _prepare(self, trajs: list[Trajectory], version: int):
        """Staleness filter, minibatch split, packing and placement, plus the proximal / reference
        log-probs computed with the params as they are before any optimizer step of this update.

        Returns (minibatches: list of (placed micro-steps, n_valid tokens), masks, staleness).
        """
        cfg, fns = self.cfg, self._fns
        if not trajs:
            raise ValueError("Trainer.update got no trajectories; pass at least one.")
        masks, staleness = batching.effective_masks(trajs, version, self.max_staleness)
        need_prox = cfg.recomputes_prox
        plan = []  # per minibatch: (host micro-steps, n_valid tokens)
        for indices in batching.split_minibatches(trajs, cfg.ppo_minibatches):
            weights = [None] * len(trajs)
            for i, w in zip(indices, batching.aggregation_weights([masks[i] for i in indices], cfg.loss_agg)):
                weights[i] = w
            n_valid, _ = batching.count_valid(masks, indices)
            plan.append((self._steps(trajs, indices, masks, weights, version) if n_valid else [], n_valid))
        fields = model_fields(self.cfg) + LOSS_FIELDS
        prox = {}
        if self._critic:  # values and proximal log-probs in one forward, then GAE replaces the advantages
            fields += CRITIC_FIELDS
            all_steps = [step for steps, _ in plan for step in steps]
            values, logps = self._values(trajs, all_steps)
            prox = {id(step): logp for step, logp in zip(all_steps, logps)}
            advantages, returns = self._gae(trajs, masks, values)
            for step in all_steps:
                for name, per_traj in (("advantages", advantages), ("old_values", values), ("returns", returns)):
                    batching.fill_steps(step, name, per_traj)
        train = self.state.trainable()
        minibatches = []
        for steps, n_valid in plan:
            placed = []
            for step in steps:
                batch = self._place(step, fields)
                model_inputs = {k: batch[k] for k in model_fields(cfg)}
                if need_prox:
                    known = prox.get(id(step))
                    batch["prox_logp"] = known if known is not None else fns.forward(train, self._other, model_inputs)
                if self._ref is not None and cfg.kl_coef > 0:
                    ref = (self._ref[0], self.state.value_head) if self._critic else self._ref[0]
                    out = fns.forward(ref, self._ref[1], model_inputs)
                    batch["ref_logp"] = out[0] if self._critic else out
                placed.append(batch)
            minibatches.append((placed, n_valid))
        return minibatches, masks, staleness

    def _accumulate(self, placed, version_arr):
        train = self.state.trainable()
        grads = self._fns.zero_grads(train)
        sums = self._fns.zero_metrics()
        for batch in placed:
            grads, sums = self._fns.accumulate(train, self._other, grads, sums, batch, version_arr)
        return grads, sums

    def loss_and_grads(self, trajectories: Sequence[Trajectory]) -> tuple[float, nnx.State]:
        """The objective of the batch taken as ONE minibatch and its gradient w.r.t. the params, by the
        same packed micro-step accumulation the update uses (nothing is applied). For tests and
        diagnostics. Returns (loss, grads) with grads shaped like `Trainer.state.trainable()` (the params,
        or (params, value_head) with a critic)."""
        version = self.version
        minibatches, _, _ = self._prepare(list(trajectories), version)
        if len(minibatches) != 1:
            raise ValueError("loss_and_grads treats the batch as one minibatch; use ppo_minibatches=1.")
        version_arr = put_global(jnp.asarray(version, jnp.int32), replicated(self.mesh))
        grads, sums = self._accumulate(minibatches[0][0], version_arr)
        return float(jax.device_get(sums["loss"])), grads

    def update(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One PPO update on a batch of trajectories; the policy version goes up by one.

        Steps: staleness filter -> split into cfg.ppo_minibatches minibatches -> pack each into
        micro-steps -> proximal (and reference) log-probs with the params at the start of the update
        -> per minibatch: accumulate gradients over its micro-steps, then one optimizer step, skipped
        (and counted in skipped_updates) when the gradients or loss are not finite.

        Returns metrics (python floats): loss, pg_loss, kl, clip_fraction, dual_clip_fraction, behav_weight_mean,
        behav_weight_max, masked_fraction, approx_kl, entropy, grad_norm, n_tokens, n_seqs,
        staleness_mean, staleness_max, stale_dropped_fraction, skipped_updates, lr, version, packed_fraction
        (the share of the packed positions that hold tokens), compiled_shapes (micro-step shapes packed so far,
        `layouts`), micro_steps (in this update); with a critic also value_loss (the aggregated value loss, before value_coef), value_clip_fraction and
        value_error (token mean of (V - return)^2), at the params before each optimizer step; with a mixture of experts
        also moe_aux_loss, moe_max_load and moe_min_load (`update.router_metrics`).
        """
        trajs = list(trajectories)
        version = self.version
        self._packed[:] = 0
        minibatches, masks, staleness = self._prepare(trajs, version)
        packing = {"packed_fraction": float(self._packed[0] / max(self._packed[1], 1)),
                   "compiled_shapes": float(len(self.layouts.compiled)),
                   "micro_steps": float(sum(len(placed) for placed, _ in minibatches))}
        rep = replicated(self.mesh)
        version_arr = put_global(jnp.asarray(version, jnp.int32), rep)
        sums_total, infos = None, []
        for k, (placed, n_valid) in enumerate(minibatches):
            grads, sums = self._accumulate(placed, version_arr)
            last = int(k == len(minibatches) - 1)
            scalars = put_global(
                (jnp.asarray(n_valid, jnp.float32), jnp.asarray(last, jnp.int32)), (rep, rep)
            )
            if last and self._copy is not None:  # the step that ends the update also writes the sampler's copy
                self.state, info, copy = self._fns.apply_cast(*self._copy.step_key)(self.state, grads, sums, *scalars)
                self._copy.record(version + 1, copy)
            else:
                self.state, info = self._fns.apply(self.state, grads, sums, *scalars)
            infos.append(info)
            sums_total = sums if sums_total is None else update_lib.merge_sums(sums_total, sums)
        return update_lib.update_metrics(
            jax.device_get(sums_total), jax.device_get(infos), masks, trajs, staleness, len(minibatches), self.state
        ) | packing


def _attention_weight(model: nnx.Module, *states: nnx.State) -> float:
    """layout.attention_weight of the model (0 without a ModelConfig: row lengths by positions only)."""
    cfg = model_config_of(model, required=False)
    n_params = sum(int(x.size) for state in states for x in jax.tree.leaves(state))
    return layout.attention_weight(cfg, n_params) if cfg is not None and n_params else 0.0


def _fetch(x: jax.Array) -> np.ndarray:
    """A global array as one host numpy array (gathered from every process when sharded across them)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _scatter(out: list[np.ndarray], values: np.ndarray, step: dict[str, np.ndarray]) -> None:
    """Write packed per-position values back to per-trajectory completion arrays."""
    sel = step["seq_index"] >= 0
    for i, j, v in zip(step["seq_index"][sel], step["comp_index"][sel], values[sel]):
        out[i][j] = v
