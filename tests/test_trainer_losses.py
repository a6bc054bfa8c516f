"""The packed trainer's objective equals the pure aggregated rl.losses API on the same batch, for every
loss (decoupled, ppo, gspo) and aggregation mode: one aggregation, however the tokens are packed."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.rl import losses as L
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.trainer import Trainer, TrainerConfig
from tests.test_trainer import make_trajs, mesh_4, tree_rel_err


def unpacked_arrays(trajs):
    """[N, W] tokens (one trajectory per row) and [N, C] completion-aligned gather indices, targets,
    behaviour log-probs, advantages and masks."""
    n, width, c_max = len(trajs), max(t.tokens.size for t in trajs), max(t.completion_len for t in trajs)
    out = {k: np.zeros((n, c_max), np.float32) for k in ("behav", "adv", "mask")}
    out.update(tokens=np.zeros((n, width), np.int32), gather=np.zeros((n, c_max), np.int32),
               targets=np.zeros((n, c_max), np.int32))
    for i, t in enumerate(trajs):
        c = t.completion_len
        out["tokens"][i, : t.tokens.size] = t.tokens
        out["gather"][i, :c] = np.arange(t.prompt_len - 1, t.tokens.size - 1)
        out["targets"][i, :c] = t.tokens[t.prompt_len:]
        out["behav"][i, :c] = t.behav_logp
        out["adv"][i, :c] = t.completion_advantages()
        out["mask"][i, :c] = t.completion_mask()
    return out


def pure_objective(model, trajs, cfg):
    """(loss, grads, stats) of cfg.loss from rl.losses' aggregated API on unpacked [N, C] arrays."""
    a = unpacked_arrays(trajs)

    def logp_of(m):
        logits = m(jnp.asarray(a["tokens"]))
        logits = jnp.take_along_axis(logits, jnp.asarray(a["gather"])[..., None], axis=1)
        return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(a["targets"])[..., None], -1)[..., 0]

    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    prox = jax.lax.stop_gradient(logp_of(model))
    clip = dict(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, dual_clip=cfg.dual_clip, agg=cfg.loss_agg)
    cap = dict(behav_weight_cap=cfg.behav_weight_cap, behav_weight_mode=cfg.behav_weight_mode)

    def objective(p):
        logp = logp_of(nnx.merge(graphdef, p, other))
        if cfg.loss == "ppo":
            return L.ppo_loss(logp, a["behav"], a["adv"], a["mask"], **clip)
        fn = L.gspo_loss if cfg.loss == "gspo" else L.decoupled_ppo_loss
        return fn(logp, prox, a["behav"], a["adv"], a["mask"], **clip, **cap)

    (loss, stats), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return float(loss), grads, {k: float(v) for k, v in stats.items()}


CASES = [
    dict(loss="decoupled", loss_agg="token-mean"),
    dict(loss="decoupled", loss_agg="seq-mean-token-mean", dual_clip=2.0),
    dict(loss="decoupled", loss_agg="seq-mean-token-sum", behav_weight_cap=1.2),
    dict(loss="ppo", loss_agg="seq-mean-token-mean", eps_clip_high=0.28),
    dict(loss="gspo", loss_agg="token-mean", eps_clip=0.02),
    dict(loss="gspo", loss_agg="seq-mean-token-mean", eps_clip=0.02, behav_weight_cap=1.3),
    dict(loss="gspo", loss_agg="seq-mean-token-sum"),
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_packed_trainer_loss_equals_pure_aggregated_api(overrides):
    cfg = TrainerConfig(micro_batch_tokens=40, logits_chunk=8, **overrides)
    model = random_model(tiny_config(), seed=5)
    trajs = make_trajs(9, seed=2)  # 9 trajectories of 5-23 tokens: several per packed row
    trainer = Trainer(model, cfg, mesh_4())
    rng = np.random.default_rng(7)
    for t, lp in zip(trajs, trainer.compute_logprobs(trajs)):
        t.behav_logp = (lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32)  # weights straddle the cap
    loss, grads = trainer.loss_and_grads(trajs)
    want, want_grads, _ = pure_objective(model, trajs, cfg)
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert tree_rel_err(jax.device_get(grads), want_grads) < 1e-5


@pytest.mark.parametrize("loss", ["ppo", "decoupled"])
def test_update_reports_the_clip_fractions_of_the_pure_api(loss):
    """One single-minibatch update reports the token shares its objective clipped and dual-clipped, as the pure
    API counts them at the update's starting params (behaviour far from the policy, so both clips act)."""
    cfg = TrainerConfig(micro_batch_tokens=40, logits_chunk=8, loss=loss, dual_clip=1.1, eps_clip=0.1)
    model = random_model(tiny_config(), seed=5)
    trajs = make_trajs(9, seed=2)
    trainer = Trainer(model, cfg, mesh_4())
    rng = np.random.default_rng(3)
    for t, lp in zip(trajs, trainer.compute_logprobs(trajs)):
        t.behav_logp = (lp + rng.normal(0, 0.5, lp.shape)).astype(np.float32)
    _, _, want = pure_objective(model, trajs, cfg)
    metrics = trainer.update(trajs)
    if loss == "ppo":  # the ratio is to the behaviour policy: both clips see the noise
        assert 0 < want["dual_clip_fraction"] < want["clip_fraction"] < 1
    else:  # at the update's start the current policy is the proximal one: u = 1, nothing is clipped
        assert want["dual_clip_fraction"] == want["clip_fraction"] == 0
    for key in ("clip_fraction", "dual_clip_fraction"):
        assert metrics[key] == pytest.approx(want[key], abs=1e-6), key
