"""Turn a validated ml_collections config into the settings objects of each part."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax import config as config_lib
from areal_jax.models.lora import LoRAConfig
from areal_jax.runtime.mesh import MeshConfig
from areal_jax.system.controller import RolloutSettings
from areal_jax.trainer.config import TrainerConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

REWARD_FUNCTIONS = {
    "math": "areal_jax.rewards.math:math_reward",
    "exact": "areal_jax.rewards.exact:exact_match_reward",
}


def mesh_config(config: Any) -> MeshConfig:
    m = config.mesh
    return MeshConfig(
        train_devices=m.train_devices,
        rollout_devices=m.rollout_devices,
        train_fraction=m.train_fraction,
        fsdp=m.fsdp,
        tensor=m.tensor,
        rollout_tensor=m.rollout_tensor,
        colocated=m.colocated,
    )


def trainer_config(config: Any) -> TrainerConfig:
    t = config.train
    return TrainerConfig(
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        schedule=t.schedule,
        total_steps=config.total_steps * t.ppo_minibatches,
        min_lr_ratio=t.min_lr_ratio,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        loss=t.loss,
        eps_clip=t.eps_clip,
        eps_clip_high=t.eps_clip_high,
        behav_weight_cap=t.behav_weight_cap,
        behav_weight_mode=t.behav_weight_mode,
        dual_clip=t.dual_clip,
        loss_agg=t.loss_agg,
        prox_mode=t.prox_mode,
        ppo_minibatches=t.ppo_minibatches,
        micro_batch_tokens=t.micro_batch_tokens,
        max_staleness=config_lib.max_staleness(config),
        kl_coef=t.kl_coef,
        kl_estimator=t.kl_estimator,
        entropy_coef=t.entropy_coef,
        logits_chunk=t.logits_chunk,
        attention=t.attention,
        remat=t.remat,
    )


def lora_config(config: Any) -> LoRAConfig | None:
    """The adapter settings (None when lora.enabled is False); raises ValueError on a bad value."""
    lo = config.lora
    if not lo.enabled:
        return None
    return LoRAConfig(rank=lo.rank, alpha=float(lo.alpha), dropout=float(lo.dropout), targets=lo.targets,
                      base_dtype=lo.base_dtype)


def rollout_settings(config: Any, stop_token_ids: tuple[int, ...], batch_groups: int | None = None) -> RolloutSettings:
    """batch_groups: this process's share of train.batch_groups (default: all of it)."""
    r = config.rollout
    return RolloutSettings(
        group_size=r.group_size,
        batch_groups=batch_groups or config.train.batch_groups,
        max_new_tokens=r.max_new_tokens,
        max_staleness=config_lib.max_staleness(config),
        max_concurrent=r.max_concurrent,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        stop_token_ids=tuple(stop_token_ids),
        filter_uniform_groups=r.filter_uniform_groups,
        advantage_mode=r.advantage_mode,
    )


def reward_fn(config: Any) -> Any:
    """What the RewardPool runs: reward.fn as a "module:function" string, or for reward.fn=code the
    sandboxed test reward (rewards/code.py) with reward.code_mode and its time limits bound in."""
    r = config.reward
    if r.fn == "code":
        from areal_jax.rewards.code import make_code_reward

        return make_code_reward(r.code_mode, r.code_case_timeout_s, r.code_sample_timeout_s)
    return reward_fn_spec(r.fn)


def reward_fn_spec(name: str) -> str:
    """"math" / "exact" / "package.module:function" -> an importable "module:function" string."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    if ":" not in name:
        raise ValueError(
            f"reward.fn={name!r} is neither a built-in ({', '.join(REWARD_FUNCTIONS)}, code) nor an importable "
            "'module:function' path."
        )
    return name
