"""TrainerConfig: the `train` section, every knob of the PPO update, validated before anything is compiled."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from areal_jax.knobs import Section, knob, require


@dataclasses.dataclass(frozen=True)
class TrainerConfig(Section):
    """Optimizer, loss and batching settings of the PPO update (the config's `train` section).

    What the trainer also needs from other sections (the schedule's length from total_steps and
    ppo_minibatches, rollout.max_staleness) is passed to `Trainer(...)` at construction.
    """

    section: ClassVar[str] = "train"

    batch_groups: int = knob(16, "B: groups (prompts) per update")
    lr: float = knob(1e-5, "peak learning rate (AdamW)")
    warmup_steps: int = knob(0, "optimizer steps of linear warm-up from 0 to lr")
    schedule: str = knob("constant", "constant after warm-up, or cosine decay to lr * min_lr_ratio at the last "
                         "optimizer step (total_steps x ppo_minibatches)", choices=("constant", "cosine"))
    weight_decay: float = knob(0.0, "AdamW decoupled weight decay, on matrices only (not norms or biases)")
    max_grad_norm: float | None = knob(1.0, "clip the global gradient norm to this (None: no clipping)")
    loss: str = knob("decoupled", "decoupled (AReaL's three-policy objective) | ppo (the standard clipped objective "
                     "against the behaviour policy) | gspo (sequence-level ratio per trajectory, with the decoupled "
                     "objective's proximal policy and behaviour weights; GSPO clips ~3e-4)",
                     choices=("decoupled", "ppo", "gspo"))
    eps_clip: float = knob(0.2, "clip range [1 - eps_clip, 1 + eps_clip_high] of the policy ratio")
    eps_clip_high: float | None = knob(None, "upper clip (None: eps_clip); DAPO's clip-higher")
    behav_weight_cap: float | None = knob(None, "cap on w = pi_prox / pi_behav (None: plain w)")
    behav_weight_mode: str = knob("mask", "mask (drop tokens with w above the cap) | clamp (use min(w, cap))",
                                  choices=("mask", "clamp"))
    dual_clip: float | None = knob(None, "dual-clip constant c > 1 capping each token's loss at c * |A| (None: off)")
    loss_agg: str = knob("token-mean", "aggregation over each PPO minibatch (packing does not change the objective)",
                         choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    prox_mode: str = knob("recompute", "proximal log-probs: recompute (one forward of the params at the update's "
                          "start) | loglinear (AReaL's version-interpolated approximation, no extra forward) | behav "
                          "(proximal = behaviour)", choices=("recompute", "loglinear", "behav"))
    ppo_minibatches: int = knob(1, "optimizer steps per update; the batch splits into this many minibatches of "
                                "about equal token count. With loss=decoupled and prox_mode=recompute, 1 makes the "
                                "proximal policy the one the single step starts from, so the decoupled clip never "
                                "acts (pi / pi_prox = 1)")
    micro_batch_tokens: int = knob(4096, "token budget of one device's share of a micro-step (its packed rows "
                                   "together); must hold the longest trajectory")
    micro_step_overhead: int = knob(256, "the fixed cost of one micro-step in positions of work, against which "
                                    "packing weighs padding (trainer.layout.step_layout); raise it where launching "
                                    "a micro-step costs more (a small model on a large accelerator)")
    new_shape_cost: float = knob(8.0, "a micro-step shape not compiled yet is taken once the padding it would have "
                                 "saved adds up to this many micro-steps of micro_batch_tokens (trainer.layout."
                                 "ShapeBook); 0 always packs the cheapest layout, whatever it compiles")
    warm_up: bool = knob(True, "the job compiles the update's programs for rows holding rollout.max_len tokens (as "
                         "many as micro_batch_tokens holds) while the start evaluation and first rollouts run, "
                         "instead of when the first batch arrives (trainer.warmup)")
    kl_coef: float = knob(0.0, "weight of the KL penalty to the starting checkpoint (0 disables it)")
    kl_estimator: str = knob("k3", "KL estimator", choices=("k1", "k2", "k3"))
    entropy_coef: float = knob(0.0, "weight of the entropy bonus (subtracted from the loss)")
    router_aux_coef: float = knob(0.0, "mixture-of-experts models: weight of transformers' load-balancing loss over "
                                  "each micro-step's tokens (models.moe.load_balancing_loss; 0: the router's load is "
                                  "only reported, as train/moe_*)")
    router_bias_rate: float = knob(0.0, "mixture-of-experts models with a picking bias (DeepSeek-V3's "
                                   "router_score_bias): after each optimizer step every expert's bias moves this much "
                                   "toward balance, up when the minibatch picked it less than its layer's mean, down "
                                   "when more (auxiliary-loss-free balancing, trainer.balance; 0: kept as loaded)")
    router_replay: str = knob("off", "mixture-of-experts models: the sampler's routing (the experts it sent each token "
                              "to, recorded per finished sequence). measure: report train/moe_route_agreement (the "
                              "share of the trainer's own top-k picks the sampler made too); replay: also send each "
                              "token to the sampler's experts in every training forward (rollout routing replay), "
                              "weighted by the trainer's router", choices=("off", "measure", "replay"))
    min_lr_ratio: float = knob(0.0, "final learning rate of the cosine schedule, as a fraction of lr")
    logits_chunk: int = knob(512, "tokens per chunk of the vocabulary projection on one device, bounding the live "
                             "logits to about logits_chunk x vocab float32")
    attention: str = knob("auto", "attention over packed rows in training: auto (blocked on CPU, flash on GPU / "
                          "TPU) | dense | blocked | flash (Pallas kernel, linear memory)",
                          choices=("auto", "dense", "blocked", "flash"))
    remat: str = knob("auto", "rematerialisation per decoder layer in the backward: auto (on a device that reports "
                      "its memory, the first of none / dots / full whose update fits beside everything else the "
                      "device holds, measured by XLA (trainer.memory); none on the CPU) | none | full (keep only "
                      "each layer's input) | dots (keep the projections' matmul outputs)",
                      choices=("auto", "none", "full", "dots"))
    scan_layers: bool = knob(False, "run the update's decoder layers as one lax.scan: the program holds one layer, "
                             "so it traces and compiles in about one layer's time, for one stacked copy of the layer "
                             "weights and of their gradients during each micro-step (False: unrolled)")
    b1: float = knob(0.9, "Adam first-moment decay")
    b2: float = knob(0.999, "Adam second-moment decay")
    eps: float = knob(1e-8, "Adam epsilon")
    moment_dtype: str = knob("float32", "storage of AdamW's two moments: float32 (8 bytes a trained parameter) | "
                             "bfloat16 (4 bytes, stochastic rounding; the step computes in float32: "
                             "trainer/low_precision.py)", choices=("float32", "bfloat16"))
    critic: str = knob("none", "none (group advantages from rollout.advantage_mode) | value_head (critic PPO: a "
                       "float32 Linear hidden->1 on the policy trunk, GAE token advantages replace the group ones)",
                       choices=("none", "value_head"))
    gamma: float = knob(1.0, "critic: GAE discount in [0, 1]")
    lam: float = knob(0.95, "critic: GAE lambda in [0, 1]")
    whiten_advantages: bool = knob(True, "critic: shift and scale the GAE advantages to mean 0, std 1 over the "
                                   "update's valid tokens (the returns the value head learns stay unscaled)")
    value_coef: float = knob(0.5, "critic: weight of the value loss added to the policy loss")
    value_clip: float | None = knob(0.2, "critic: clip of the value change around the update-start values "
                                    "(None: plain squared error)")

    @property
    def recomputes_prox(self) -> bool:
        """Whether an update runs a forward of its starting params for the proximal log-probs."""
        return self.loss in ("decoupled", "gspo") and self.prox_mode == "recompute"

    def check(self) -> None:
        k = self.key
        require(self.batch_groups >= 1, f"{k('batch_groups')}={self.batch_groups} must be at least 1.")
        require(self.lr > 0, f"{k('lr')}={self.lr} must be positive.")
        require(self.warmup_steps >= 0, f"{k('warmup_steps')}={self.warmup_steps} must be >= 0.")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"{k('min_lr_ratio')}={self.min_lr_ratio} must lie in [0, 1].")
        require(self.weight_decay >= 0, f"{k('weight_decay')}={self.weight_decay} must be >= 0.")
        require(self.max_grad_norm is None or self.max_grad_norm > 0,
                f"{k('max_grad_norm')}={self.max_grad_norm} must be positive (or None to disable clipping).")
        require(0 <= self.b1 < 1 and 0 <= self.b2 < 1,
                f"Adam {k('b1')}={self.b1}, {k('b2')}={self.b2} must lie in [0, 1).")
        require(self.eps > 0, f"{k('eps')}={self.eps} must be positive.")
        require(self.eps_clip > 0, f"{k('eps_clip')}={self.eps_clip} must be positive.")
        require(self.eps_clip_high is None or self.eps_clip_high > 0,
                f"{k('eps_clip_high')}={self.eps_clip_high} must be positive (or None to use eps_clip).")
        require(self.behav_weight_cap is None or self.behav_weight_cap > 0,
                f"{k('behav_weight_cap')}={self.behav_weight_cap} must be positive (or None for no cap).")
        require(self.dual_clip is None or self.dual_clip > 1,
                f"{k('dual_clip')}={self.dual_clip} must be greater than 1 (or None to disable it).")
        require(self.ppo_minibatches >= 1, f"{k('ppo_minibatches')}={self.ppo_minibatches} must be at least 1.")
        require(self.batch_groups % self.ppo_minibatches == 0,
                f"{k('batch_groups')}={self.batch_groups} is not divisible by {k('ppo_minibatches')}="
                f"{self.ppo_minibatches}.")
        require(self.micro_batch_tokens >= 8, f"{k('micro_batch_tokens')}={self.micro_batch_tokens} must be at least 8.")
        require(self.micro_step_overhead >= 0, f"{k('micro_step_overhead')}={self.micro_step_overhead} must be >= 0.")
        require(self.new_shape_cost >= 0, f"{k('new_shape_cost')}={self.new_shape_cost} must be >= 0.")
        require(self.kl_coef >= 0, f"{k('kl_coef')}={self.kl_coef} must be >= 0.")
        require(self.entropy_coef >= 0, f"{k('entropy_coef')}={self.entropy_coef} must be >= 0.")
        require(self.router_aux_coef >= 0, f"{k('router_aux_coef')}={self.router_aux_coef} must be >= 0.")
        require(self.router_bias_rate >= 0, f"{k('router_bias_rate')}={self.router_bias_rate} must be >= 0.")
        require(self.logits_chunk >= 1, f"{k('logits_chunk')}={self.logits_chunk} must be at least 1.")
        require(0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0,
                f"{k('gamma')}={self.gamma} and {k('lam')}={self.lam} must lie in [0, 1].")
        require(self.value_coef >= 0, f"{k('value_coef')}={self.value_coef} must be >= 0.")
        require(self.value_clip is None or self.value_clip > 0,
                f"{k('value_clip')}={self.value_clip} must be positive (or None for the plain squared error).")
