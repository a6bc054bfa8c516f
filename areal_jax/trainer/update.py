"""The jitted pieces of one PPO update: log-prob forward, micro-step gradient accumulation, apply.

Why a Python loop over micro-steps with a jitted accumulate step rather than one `lax.scan`: the number
of micro-steps changes from batch to batch (it follows the packed token count), so a scan would either
recompile for every new count or burn compute on padded micro-steps. The accumulate step compiles once
per row-length bucket (at most eight), each call costs one dispatch, negligible next to a micro-step's
forward and backward, and the gradient accumulator is donated so it is updated in place.

The loss of a micro-step is sum_t weight_t * loss_t, with the weights of rl.aggregation.token_weights
computed over the whole minibatch before packing (trainer.batch), so the sum over the micro-steps of a
minibatch is rl.losses' aggregation over that minibatch. The per-token losses are rl.losses' per-token
forms called on the packed rows, so every loss option (clip, dual clip, behaviour-weight cap) keeps its
exact rl.losses meaning; GSPO takes its sequence ratio per packed segment (segment ids).

Proximal log-probs (`prox_mode`):
  * "recompute": one forward pass of the params at the start of the update (before any optimizer step
    of this update), passed in as `prox_logp`.
  * "loglinear" (AReaL's approximation, no extra forward): with v the trainer version at the start of
    the update (the params' version: the proximal policy), v + 1 the version being produced (the policy
    theta), and v_b the version that sampled the token,
        alpha = clip((v - v_b) / (v + 1 - v_b), 0, 1),
        prox_logp = behav_logp + alpha * (stop_gradient(logp_theta) - behav_logp),
    i.e. the log-prob interpolated linearly in version between the behaviour policy (at v_b) and the
    current policy (at v + 1), evaluated at the proximal version v. Fresh tokens (v_b = v) get
    prox = behav; very stale ones approach the current log-prob.
  * "behav": prox_logp = behav_logp (no importance weight).
With loss="ppo" the standard clipped objective against behav_logp is used and prox_mode is ignored;
loss="gspo" uses the proximal log-probs like "decoupled".
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models.flat_params import cast_leaves
from areal_jax.models.moe import load_balancing_loss, moe_layer_count
from areal_jax.models.sharding import auto_mesh
from areal_jax.rl.losses import (
    decoupled_ppo_token_loss,
    gspo_token_loss,
    kl_token_penalty,
    ppo_token_loss,
    value_token_loss,
)
from areal_jax.trainer import balance
from areal_jax.trainer.batch import staleness_stats
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.logprobs import model_outputs
from areal_jax.trainer.state import TrainState

MODEL_FIELDS = ("tokens", "positions", "segment_ids", "targets")
LOSS_FIELDS = ("mask", "behav_logp", "versions", "advantages", "weights")
CRITIC_FIELDS = ("old_values", "returns")
CRITIC_METRICS = ("value_loss", "value_clip", "value_error")
SUM_METRICS = ("loss", "pg_loss", "kl", "entropy", "clip", "dual_clip", "behav_weight", "masked", "approx_kl",
               "n_valid", "router_aux", "route_agree", "route_picks", *CRITIC_METRICS)
ROUTER_COUNTS = "router_counts"  # [L_moe, E] top-k picks per expert, summed (mixture-of-experts models only)


def model_fields(cfg: TrainerConfig) -> tuple[str, ...]:
    """The micro-step arrays a forward reads: MODEL_FIELDS, and "routes" ([F * R, T, L_moe, k] int32, the
    sampler's experts of each position's token) when cfg.router_replay is on."""
    return MODEL_FIELDS + (("routes",) if cfg.router_replay != "off" else ())


def loglinear_prox(logp: jax.Array, behav_logp: jax.Array, versions: jax.Array, version: jax.Array) -> jax.Array:
    """AReaL's log-linear proximal log-prob (see the module docstring). All [B, T]; version: [] int32."""
    v = version.astype(jnp.float32)
    vb = versions.astype(jnp.float32)
    span = v + 1.0 - vb
    alpha = jnp.where(span > 0, jnp.clip((v - vb) / jnp.where(span > 0, span, 1.0), 0.0, 1.0), 0.0)
    return behav_logp + alpha * (jax.lax.stop_gradient(logp) - behav_logp)


def logits_chunk_positions(n_rows: int, n_devices: int, logits_chunk: int) -> int:
    """Positions per chunk of the vocabulary projection so that one device's live logits block
    (its rows x chunk x vocab) holds about `logits_chunk` tokens."""
    return max(1, logits_chunk // max(1, n_rows // n_devices))


def policy_token_loss(
    cfg: TrainerConfig, logp: jax.Array, behav: jax.Array, adv: jax.Array, mask: jax.Array,
    batch: dict[str, jax.Array], version: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The per-token policy loss of cfg.loss on packed rows (rl.losses' per-token forms).

    logp, behav, adv, mask: [R, T]; batch supplies "prox_logp" (prox_mode recompute), "versions"
    (loglinear) and "segment_ids" (gspo: one sequence ratio per packed trajectory).
    Returns (per_token [R, T], token stats [R, T]).
    """
    if cfg.loss == "ppo":
        return ppo_token_loss(logp, behav, adv, mask, eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high,
                              dual_clip=cfg.dual_clip)
    if cfg.prox_mode == "recompute":
        prox = batch["prox_logp"]
    elif cfg.prox_mode == "loglinear":
        prox = loglinear_prox(logp, behav, batch["versions"], version)
    else:
        prox = behav
    options = dict(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, behav_weight_cap=cfg.behav_weight_cap,
                   behav_weight_mode=cfg.behav_weight_mode, dual_clip=cfg.dual_clip)
    if cfg.loss == "gspo":
        return gspo_token_loss(logp, prox, behav, adv, mask, segment_ids=batch["segment_ids"], **options)
    return decoupled_ppo_token_loss(logp, prox, behav, adv, mask, **options)


def micro_step_objective(
    params: nnx.State, other: nnx.State, graphdef: nnx.GraphDef, batch: dict[str, jax.Array],
    version: jax.Array, cfg: TrainerConfig, n_devices: int = 1, value_head: dict[str, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted loss of one micro-step and its metric sums.

    batch: [F * R, T] arrays named in MODEL_FIELDS + LOSS_FIELDS, plus "prox_logp" (prox_mode
    recompute), "ref_logp" (kl_coef > 0) and CRITIC_FIELDS (value_head given). n_devices: F.
    value_head: the critic's head; its clipped value loss (rl.losses.value_token_loss against
    batch["returns"], clipped around batch["old_values"]) enters with cfg.value_coef.
    Returns (objective [], metric sums of []).
    """
    chunk = logits_chunk_positions(batch["tokens"].shape[0], n_devices, cfg.logits_chunk)
    logp, ent, values, router = model_outputs(
        graphdef, params, other, *(batch[k] for k in MODEL_FIELDS), chunk, value_head=value_head,
        with_entropy=True, attention=cfg.attention, remat=cfg.remat, scan_layers=cfg.scan_layers, router_stats=True,
        routes=batch.get("routes"), replay=cfg.router_replay == "replay",
    )
    mask, behav, adv, weights = batch["mask"], batch["behav_logp"], batch["advantages"], batch["weights"]
    valid = mask > 0
    losses, stats = policy_token_loss(cfg, logp, behav, adv, mask, batch, version)
    pg = jnp.sum(weights * losses)
    objective = pg
    if cfg.entropy_coef > 0:
        objective = objective - cfg.entropy_coef * jnp.sum(weights * ent)
    kl_sum = jnp.zeros((), jnp.float32)
    if cfg.kl_coef > 0:
        kl_tok = kl_token_penalty(logp, batch["ref_logp"], mask, estimator=cfg.kl_estimator)
        kl_sum = jnp.sum(weights * kl_tok)
        objective = objective + cfg.kl_coef * kl_sum
    sg = jax.lax.stop_gradient
    on = lambda x: jnp.sum(jnp.where(valid, sg(x), 0.0))  # noqa: E731
    critic = {k: jnp.zeros((), jnp.float32) for k in CRITIC_METRICS}
    if value_head is not None:
        v_tok, v_stats = value_token_loss(values, batch["old_values"], batch["returns"], mask,
                                          value_clip=cfg.value_clip)
        v_sum = jnp.sum(weights * v_tok)
        objective = objective + cfg.value_coef * v_sum
        critic = {"value_loss": sg(v_sum), "value_clip": on(v_stats["value_clipped"]),
                  "value_error": on(v_stats["value_error"])}

    experts = {}
    if router is not None:  # a mixture of experts: its load over this micro-step's tokens, its share of the batch
        aux = jnp.sum(weights) * load_balancing_loss(router["stats"], jnp.sum(batch["segment_ids"] > 0))
        if cfg.router_aux_coef > 0:
            objective = objective + cfg.router_aux_coef * aux
        experts = {"router_aux": sg(aux), ROUTER_COUNTS: router["stats"][:, 0]}
        if "agree" in router:  # the sampler's routes given: how many of this forward's picks it made too
            experts.update(route_agree=jnp.sum(router["agree"]), route_picks=jnp.sum(router["stats"][:, 0]))

    zero = jnp.zeros((), jnp.float32)
    metrics = {
        "router_aux": zero, "route_agree": zero, "route_picks": zero,
        **experts,
        "loss": sg(objective),
        "pg_loss": sg(pg),
        "kl": sg(kl_sum),
        "entropy": on(ent),
        "clip": on(stats["clipped"]),
        "dual_clip": on(stats["dual_clipped"]) if "dual_clipped" in stats else jnp.zeros((), jnp.float32),
        "behav_weight": on(stats["behav_weight"]),
        "behav_weight_max": jnp.max(jnp.where(valid, sg(stats["behav_weight"]), 0.0)),
        "masked": on(stats["masked"]),
        "approx_kl": on(stats["k3"]),
        "n_valid": jnp.sum(valid.astype(jnp.float32)),
        **critic,
    }
    return objective, metrics


@dataclasses.dataclass(frozen=True)
class UpdateFns:
    """Compiled pieces of the update, bound to one model graph, config, optimizer and mesh.

    `train` is TrainState.trainable(): the params, or (params, value_head) with a critic.
    forward(train, other, batch) -> logp [F * R, T] float32, or (logp, values) with a critic.
    zero_grads(train) -> grads (zeros, train shardings); zero_metrics() -> metric sums.
    accumulate(train, other, grads, metrics, batch, version) -> (grads, metrics) (grads, metrics
      donated).
    apply(state, grads, sums, n_valid, version_inc) -> (state, info) (state donated; sums: the minibatch's metric
      sums, whose loss decides whether the step is finite and whose router counts move a picking bias with
      train.router_bias_rate (`trainer.balance`); info: grad_norm, skipped, lr).
    apply_cast(dtype, copy_shardings=None) -> the same step with a third output: the new params cast to dtype, a
      flat list of fresh buffers laid out by copy_shardings (a tuple, one a leaf; None: the params' own layout)
      (`trainer.publish`; compiled once per pair).
    """

    forward: Callable
    zero_grads: Callable
    zero_metrics: Callable
    accumulate: Callable
    apply: Callable
    apply_cast: Callable
    batch_sharding: NamedSharding


def zero_metric_sums(router_shape: tuple[int, int] | None = None) -> dict[str, jax.Array]:
    """Zero metric sums; router_shape (mixture-of-experts layers, experts) adds ROUTER_COUNTS."""
    out = {k: jnp.zeros((), jnp.float32) for k in SUM_METRICS}
    out["behav_weight_max"] = jnp.zeros((), jnp.float32)
    if router_shape is not None:
        out[ROUTER_COUNTS] = jnp.zeros(router_shape, jnp.float32)
    return out


def router_metrics(sums: dict[str, Any], n_minibatches: int) -> dict[str, float]:
    """A mixture of experts' update metrics from its metric sums (none for a dense model): moe_aux_loss (the
    load-balancing loss, `models.moe.load_balancing_loss`, per minibatch; num_experts_per_tok when the load is
    uniform), moe_max_load / moe_min_load (over the expert layers, the most and the least picked expert's picks over
    its layer's mean: 1 when uniform, 0 for an expert no token picked), and with the sampler's routes
    (train.router_replay) moe_route_agreement: the share of this update's top-k picks (the params at each micro-step,
    every real token and expert layer) that the sampler made too."""
    if ROUTER_COUNTS not in sums:
        return {}
    counts = np.asarray(sums[ROUTER_COUNTS], np.float64)
    mean = counts.mean(axis=1, keepdims=True)
    load = counts / np.where(mean > 0, mean, 1.0)
    out = {"moe_aux_loss": float(sums["router_aux"]) / n_minibatches, "moe_max_load": float(load.max()),
           "moe_min_load": float(load.min())}
    if float(sums["route_picks"]) > 0:  # train.router_replay: the sampler's routes were given
        out["moe_route_agreement"] = float(sums["route_agree"]) / float(sums["route_picks"])
    return out


def router_shape(model_cfg: Any) -> tuple[int, int] | None:
    """(mixture-of-experts layers, experts) of a ModelConfig, None for a dense model (or none given)."""
    if model_cfg is None or not getattr(model_cfg, "num_experts", 0):
        return None
    return moe_layer_count(model_cfg), model_cfg.num_experts


def build_update_fns(
    graphdef: nnx.GraphDef, cfg: TrainerConfig, tx: optax.GradientTransformation,
    schedule: optax.Schedule, shardings: TrainState, other_sharding: Any, mesh: Mesh, model_cfg: Any = None,
) -> UpdateFns:
    """jit every piece with explicit NamedSharding in and out. model_cfg: the model's ModelConfig (a mixture of
    experts' metric sums then hold its router counts)."""
    rows = NamedSharding(mesh, PartitionSpec("fsdp", None))
    rep = NamedSharding(mesh, PartitionSpec())
    p_shard = shardings.trainable()
    critic = shardings.value_head is not None
    split = (lambda train: train) if critic else (lambda train: (train, None))  # noqa: E731

    n_devices = int(mesh.shape["fsdp"])
    context = auto_mesh(mesh).abstract_mesh  # traced under it: each device keeps its rows (models.sharding)

    def forward(train, other, batch):
        with jax.sharding.use_abstract_mesh(context):
            return _forward(train, other, batch)

    def _forward(train, other, batch):
        params, head = split(train)
        chunk = logits_chunk_positions(batch["tokens"].shape[0], n_devices, cfg.logits_chunk)
        logp, _, values = model_outputs(graphdef, params, other, *(batch[k] for k in MODEL_FIELDS), chunk,
                                        value_head=head, with_entropy=False, attention=cfg.attention,
                                        scan_layers=cfg.scan_layers, routes=batch.get("routes"),
                                        replay=cfg.router_replay == "replay")
        return (logp, values) if critic else logp

    def zero_grads(train):
        return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), train)

    def objective(train, other, batch, version):
        params, head = split(train)
        with jax.sharding.use_abstract_mesh(context):
            return micro_step_objective(params, other, graphdef, batch, version, cfg, n_devices, value_head=head)

    def accumulate(train, other, grads, sums, batch, version):
        g, m = jax.grad(objective, has_aux=True)(train, other, batch, version)
        grads = jax.tree.map(lambda acc, x: acc + x.astype(acc.dtype), grads, g)
        new = {k: sums[k] + m[k] for k in (*SUM_METRICS, *([ROUTER_COUNTS] if ROUTER_COUNTS in sums else []))}
        new["behav_weight_max"] = jnp.maximum(sums["behav_weight_max"], m["behav_weight_max"])
        return grads, new

    layers = balance.bias_layers(model_cfg) if cfg.router_bias_rate > 0 else ()
    if layers and balance.found_layers(split(p_shard)[0]) != layers:
        raise ValueError(f"train.router_bias_rate={cfg.router_bias_rate} moves the routers' picking bias "
                         f"(router_score_bias) of expert layers {list(layers)}, but the trained variables hold it "
                         f"for layers {list(balance.found_layers(split(p_shard)[0]))} (with LoRA the base model, its "
                         "routers included, is frozen). Set train.router_bias_rate=0.")

    def apply(state: TrainState, grads, sums, n_valid, version_inc):
        loss_sum = sums["loss"]
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss_sum)
        do_apply = finite & (n_valid > 0)
        train = state.trainable()
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, train)
        updates, opt_state = tx.update(grads, state.opt_state, train)
        new_train = optax.apply_updates(train, updates)
        if layers:  # auxiliary-loss-free balancing: the picks of this minibatch's tokens move the picking bias
            params, head = split(new_train)
            params = balance.nudge_bias(params, sums[ROUTER_COUNTS], cfg.router_bias_rate, layers)
            new_train = (params, head) if critic else params
        keep = lambda new, old: jnp.where(do_apply, new, old)  # noqa: E731
        new_state = state.with_trainable(
            jax.tree.map(keep, new_train, train),
            opt_state=jax.tree.map(keep, opt_state, state.opt_state),
            step=state.step + do_apply.astype(jnp.int32),
            version=state.version + version_inc,
            skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32),
        )
        info = {"grad_norm": grad_norm, "skipped": (~finite).astype(jnp.int32),
                "lr": jnp.asarray(schedule(state.step), jnp.float32)}
        return new_state, info

    @functools.lru_cache(maxsize=None)
    def apply_cast(dtype, copy_shardings=None):
        def step(state, grads, sums, n_valid, version_inc):
            new_state, info = apply(state, grads, sums, n_valid, version_inc)
            return new_state, info, cast_leaves(new_state.params, dtype)

        return jax.jit(step, in_shardings=(shardings, p_shard, rep, rep, rep),
                       out_shardings=(shardings, rep, list(copy_shardings or jax.tree.leaves(shardings.params))),
                       donate_argnums=(0,))

    return UpdateFns(
        forward=jax.jit(forward, in_shardings=(p_shard, other_sharding, rows),
                        out_shardings=(rows, rows) if critic else rows),
        zero_grads=jax.jit(zero_grads, in_shardings=(p_shard,), out_shardings=p_shard),
        zero_metrics=jax.jit(functools.partial(zero_metric_sums, router_shape(model_cfg)), out_shardings=rep),
        accumulate=jax.jit(
            accumulate,
            in_shardings=(p_shard, other_sharding, p_shard, rep, rows, rep),
            out_shardings=(p_shard, rep),
            donate_argnums=(2, 3),
        ),
        apply=jax.jit(
            apply,
            in_shardings=(shardings, p_shard, rep, rep, rep),
            out_shardings=(shardings, rep),
            donate_argnums=(0,),
        ),
        apply_cast=apply_cast,
        batch_sharding=rows,
    )


def merge_sums(a, b):
    """Two minibatches' metric sums added (their largest behaviour weight kept)."""
    out = {k: a[k] + b[k] for k in a}
    out["behav_weight_max"] = jnp.maximum(a["behav_weight_max"], b["behav_weight_max"])
    return out


def update_metrics(sums, infos, masks, trajs, staleness, n_minibatches: int, state: TrainState) -> dict[str, float]:
    """Trainer.update's metrics (python floats) from its minibatches' metric sums and optimizer-step infos."""
    n_valid = float(sums["n_valid"])
    per_tok = lambda key: float(sums[key]) / n_valid if n_valid > 0 else 0.0  # noqa: E731
    total_mask = sum(float(t.completion_mask().sum()) for t in trajs)
    metrics = {
        "loss": float(sums["loss"]) / n_minibatches,
        "pg_loss": float(sums["pg_loss"]) / n_minibatches,
        "kl": float(sums["kl"]) / n_minibatches,
        "clip_fraction": per_tok("clip"),
        "dual_clip_fraction": per_tok("dual_clip"),
        "behav_weight_mean": per_tok("behav_weight"),
        "behav_weight_max": float(sums["behav_weight_max"]),
        "masked_fraction": per_tok("masked"),
        "approx_kl": per_tok("approx_kl"),
        "entropy": per_tok("entropy"),
        "grad_norm": float(np.mean([float(i["grad_norm"]) for i in infos])),
        "n_tokens": n_valid,
        "n_seqs": float(sum(float(m.sum()) > 0 for m in masks)),
        "stale_dropped_fraction": 1.0 - n_valid / total_mask if total_mask > 0 else 0.0,
        "skipped_updates": float(jax.device_get(state.skipped_updates)),
        "lr": float(infos[-1]["lr"]),
        "version": float(jax.device_get(state.version)),
    }
    if state.value_head is not None:
        metrics.update(value_loss=float(sums["value_loss"]) / n_minibatches,
                       value_clip_fraction=per_tok("value_clip"), value_error=per_tok("value_error"))
    metrics.update(staleness_stats(staleness))
    return metrics | router_metrics(sums, n_minibatches)
