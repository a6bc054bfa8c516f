"""Optimizer: global-norm clipping then AdamW, with linear warm-up then a constant or cosine rate."""
from __future__ import annotations

import jax
import optax

from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.low_precision import scale_by_adam_stochastic


def make_schedule(cfg: TrainerConfig, total_steps: int = 1000) -> optax.Schedule:
    """Learning rate as a function of the optimizer step (0-based).

    Warm-up rises linearly from lr / (warmup_steps + 1) at step 0 to lr at step warmup_steps (so
    the very first step already moves the params); then "constant" stays at lr and "cosine" decays
    to lr * min_lr_ratio at step total_steps (the optimizer steps of the run: the job's total_steps x
    train.ppo_minibatches) and stays there.
    """
    peak = cfg.lr
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    else:
        if total_steps <= cfg.warmup_steps:
            raise ValueError(f"The cosine schedule's {total_steps} optimizer steps must exceed train.warmup_steps="
                             f"{cfg.warmup_steps}; raise total_steps or use --config.train.schedule=constant.")
        after = optax.cosine_decay_schedule(
            init_value=peak, decay_steps=total_steps - cfg.warmup_steps, alpha=cfg.min_lr_ratio
        )
    if cfg.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(
        init_value=peak / (cfg.warmup_steps + 1), end_value=peak, transition_steps=cfg.warmup_steps
    )
    return optax.join_schedules([warm, after], boundaries=[cfg.warmup_steps])


def decay_mask(params):
    """True for leaves that get weight decay: matrices and embeddings, not norm scales or biases."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainerConfig, total_steps: int = 1000) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) -> AdamW(schedule, b1, b2, eps, weight_decay on matrices), its moments
    stored in cfg.moment_dtype (bfloat16: `low_precision.scale_by_adam_stochastic`)."""
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    if cfg.moment_dtype != "float32":  # AdamW as optax composes it, with the moments stored in bfloat16
        return optax.chain(*parts, scale_by_adam_stochastic(cfg.b1, cfg.b2, cfg.eps, cfg.moment_dtype),
                           optax.add_decayed_weights(cfg.weight_decay, decay_mask),
                           optax.scale_by_learning_rate(make_schedule(cfg, total_steps)))
    parts.append(
        optax.adamw(
            learning_rate=make_schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
