"""Parts of an RLJob that take several config sections to build: the trained policy and the weights' way to the
sampler. `system.job.RLJob._build` calls them in order, after the memory plan has chosen the update's settings."""
from __future__ import annotations

from typing import Any

from flax import nnx

from areal_jax.config import JobConfig
from areal_jax.models.hf_io import DTYPES
from areal_jax.runtime.mesh import MeshSetup
from areal_jax.system import user_errors


def load_policy(c: JobConfig, meshes: MeshSetup, train_cfg: Any) -> tuple[nnx.Module, Any]:
    """(model, Trainer): the checkpoint at model.path on the train mesh, with LoRA adapters when lora.enabled (the
    base frozen), a frozen reference copy when train.kl_coef > 0, and the Trainer with `train_cfg` (the job's
    train section as the memory plan resolved it)."""
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.trainer import Trainer

    def load() -> nnx.Module:
        with user_errors.model_dir(c.model.path):
            return load_hf_checkpoint(c.model.path, mesh=meshes.train_mesh, param_dtype=c.model.storage_dtype,
                                      dtype=c.model.compute_dtype, max_len=c.rollout.max_len,
                                      **c.model.run_choices())

    model = load()
    lora_cfg = c.lora if c.lora.enabled else None  # adapters only are trained, the base is frozen
    if lora_cfg is not None:
        from areal_jax.models.lora import apply_lora

        apply_lora(model, lora_cfg, rngs=nnx.Rngs(c.seed))
    ref_model = None
    if c.train.kl_coef > 0:  # the reference policy for the KL penalty: the starting checkpoint, frozen
        ref_model = load()
        if lora_cfg is not None:  # same seed: the same A, B = 0, so exactly the starting checkpoint
            apply_lora(ref_model, lora_cfg, rngs=nnx.Rngs(c.seed))
    trainer = Trainer(model, train_cfg, meshes.train_mesh, ref_model=ref_model,
                      wrt=nnx.Param if lora_cfg is None else nnx.LoRAParam,
                      schedule_steps=c.optimizer_steps, max_staleness=c.rollout.eta)
    return model, trainer


def rollout_channel(c: JobConfig, model: nnx.Module, trainer: Any, meshes: MeshSetup,
                    rollout_cfg: Any) -> tuple[Any, nnx.GraphDef]:
    """(channel, graphdef): how published weights reach the rollout mesh (a ParamChannel; with LoRA an
    AdapterChannel, which moves the base once and the adapters at each publish) and the graphdef the sampler
    decodes with (the model's, or with LoRA the merged or unmerged sampler model's)."""
    from areal_jax.system.params import ParamChannel

    dtype = None if rollout_cfg.param_dtype == "same" else DTYPES[rollout_cfg.param_dtype]
    if not c.lora.enabled:
        channel = ParamChannel.for_model(trainer.params, meshes.rollout_mesh, train_mesh=meshes.train_mesh,
                                         dtype=dtype)
        # Each update writes the sampler's copy itself (trainer.publish), already in the sampler's layout where the
        # two slices share the devices: the hand-off then moves nothing.
        train_devices = set(meshes.train_mesh.devices.flat)
        shared = all(t.device_set == train_devices for t in channel.targets)
        trainer.keep_sampler_copy(dtype, channel.targets if shared else None)
        return channel, nnx.graphdef(model)
    from areal_jax.system.lora_channel import AdapterChannel, sampler_graphdef

    channel = AdapterChannel(trainer.params, meshes.rollout_mesh, scale=c.lora.scale, mode=c.lora.sampler,
                             dtype=dtype, train_mesh=meshes.train_mesh)
    return channel, sampler_graphdef(model, c.lora.sampler)


def rollout_source(trainer: Any, channel: Any) -> dict[str, Any]:
    """The keyword arguments of the channel's reshard / publish for the trainer's current params: the copy the
    trainer keeps in the sampler's dtype, owned (handed over without a second copy), where it keeps one (a plain
    ParamChannel, rollout_channel); the trained adapters alone, held flat, for an AdapterChannel (the frozen base
    is on the rollout slice already); else its params (the channel copies them)."""
    from areal_jax.models import FlatParams
    from areal_jax.system.lora_channel import AdapterChannel

    if trainer.keeps_sampler_copy:
        return {"params": trainer.sampler_copy(), "owned": True}
    if isinstance(channel, AdapterChannel):
        return {"params": FlatParams.of(trainer.state.params)}
    return {"params": trainer.params}
