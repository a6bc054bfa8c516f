"""TrainerConfig: every knob of the PPO update, validated before anything is compiled."""
from __future__ import annotations

import dataclasses

_CHOICES = {
    "schedule": ("constant", "cosine"),
    "loss": ("decoupled", "ppo"),
    "behav_weight_mode": ("mask", "clamp"),
    "loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "prox_mode": ("recompute", "loglinear", "behav"),
    "kl_estimator": ("k1", "k2", "k3"),
    "attention": ("auto", "dense", "blocked", "flash"),
    "remat": ("none", "full", "dots"),
}


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Optimizer, loss and batching settings of the PPO update.

    Attributes:
      lr: peak learning rate (AdamW).
      warmup_steps: optimizer steps of linear warm-up from 0 to lr.
      schedule: "constant" after warm-up, or "cosine" decay to lr * min_lr_ratio at total_steps.
      total_steps: optimizer steps the cosine schedule spans (warm-up included).
      min_lr_ratio: final learning rate of the cosine schedule, as a fraction of lr.
      weight_decay: AdamW decoupled weight decay, applied to matrices only (not norms or biases).
      max_grad_norm: clip the global gradient norm to this (None: no clipping).
      b1, b2, eps: Adam moments and epsilon.
      loss: "decoupled" (AReaL's three-policy objective) or "ppo" (the standard clipped objective
        against the behaviour policy).
      eps_clip, eps_clip_high: clip range [1 - eps_clip, 1 + eps_clip_high] (None high: eps_clip).
      behav_weight_cap, behav_weight_mode: cap on w = pi_prox / pi_behav ("mask" drops tokens above
        the cap, "clamp" uses min(w, cap)); None: plain w.
      dual_clip: dual-clip constant c > 1 (None: off).
      loss_agg: "token-mean", "seq-mean-token-mean" or "seq-mean-token-sum", over each PPO
        minibatch (not over micro-batches: packing does not change the objective).
      prox_mode: how the proximal log-probs are obtained: "recompute" (one forward pass of the params
        at the start of the update), "loglinear" (AReaL's version-interpolated approximation, no
        extra forward), "behav" (proximal = behaviour).
      ppo_minibatches: optimizer steps per update; the batch is split into this many minibatches of
        about equal token count.
      micro_batch_tokens: token budget of one device's share of a micro-step (its packed rows
        together); must hold the longest trajectory.
      max_staleness: drop tokens produced more than this many versions before the trainer's version
        (None: keep all).
      kl_coef, kl_estimator: weight and estimator ("k1", "k2", "k3") of the KL penalty to the
        reference model (needs ref_model; 0 disables).
      entropy_coef: weight of the entropy bonus (subtracted from the loss).
      logits_chunk: tokens per chunk of the vocabulary projection on one device (all its rows
        together), bounding the live logits to about logits_chunk x vocab float32.
      attention: attention over packed rows in the training forward: "auto" (blocked on CPU, flash on
        GPU / TPU), "dense", "blocked" or "flash" (Pallas kernel, linear memory; see
        models.packed_attention).
      remat: rematerialisation of each decoder layer in the backward: "none", "full" (keep only each
        layer's input) or "dots" (keep the projections' matmul outputs).
    """

    lr: float = 1e-5
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    loss: str = "decoupled"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    behav_weight_cap: float | None = None
    behav_weight_mode: str = "mask"
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    prox_mode: str = "recompute"
    ppo_minibatches: int = 1
    micro_batch_tokens: int = 4096
    max_staleness: int | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    logits_chunk: int = 1024
    attention: str = "auto"
    remat: str = "none"

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"TrainerConfig.{name}={value!r} is not one of {', '.join(choices)}.")
        checks = [
            (self.lr >= 0, f"lr={self.lr} must be >= 0."),
            (self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps} must be >= 0."),
            (self.total_steps >= 1, f"total_steps={self.total_steps} must be at least 1."),
            (
                self.schedule != "cosine" or self.total_steps > self.warmup_steps,
                f"total_steps={self.total_steps} must exceed warmup_steps={self.warmup_steps} for the "
                "cosine schedule; raise total_steps or use schedule='constant'.",
            ),
            (0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]."),
            (self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0."),
            (
                self.max_grad_norm is None or self.max_grad_norm > 0,
                f"max_grad_norm={self.max_grad_norm} must be positive (or None to disable clipping).",
            ),
            (0 <= self.b1 < 1 and 0 <= self.b2 < 1, f"Adam b1={self.b1}, b2={self.b2} must lie in [0, 1)."),
            (self.eps_clip > 0, f"eps_clip={self.eps_clip} must be positive."),
            (
                self.eps_clip_high is None or self.eps_clip_high > 0,
                f"eps_clip_high={self.eps_clip_high} must be positive (or None to use eps_clip).",
            ),
            (
                self.behav_weight_cap is None or self.behav_weight_cap > 0,
                f"behav_weight_cap={self.behav_weight_cap} must be positive (or None for no cap).",
            ),
            (
                self.dual_clip is None or self.dual_clip > 1,
                f"dual_clip={self.dual_clip} must be greater than 1 (or None to disable it).",
            ),
            (self.ppo_minibatches >= 1, f"ppo_minibatches={self.ppo_minibatches} must be at least 1."),
            (self.micro_batch_tokens >= 8, f"micro_batch_tokens={self.micro_batch_tokens} must be at least 8."),
            (
                self.max_staleness is None or self.max_staleness >= 0,
                f"max_staleness={self.max_staleness} must be >= 0 (or None to keep every token).",
            ),
            (self.kl_coef >= 0, f"kl_coef={self.kl_coef} must be >= 0."),
            (self.entropy_coef >= 0, f"entropy_coef={self.entropy_coef} must be >= 0."),
            (self.logits_chunk >= 1, f"logits_chunk={self.logits_chunk} must be at least 1."),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"TrainerConfig.{message}")

    def replace(self, **changes) -> "TrainerConfig":
        return dataclasses.replace(self, **changes)
