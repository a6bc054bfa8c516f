"""The PPO update: mesh parity, packing invariance against a padded reference, skipped updates, eta=0."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from areal_jax.rl.losses import aggregate, decoupled_ppo_loss, kl_penalty, token_entropy
from areal_jax.runtime.mesh import MeshConfig, build_meshes
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig, layout

VOCAB = 97
# 5-23 tokens, 15% of completion tokens out of the loss
make_trajs = functools.partial(random_trajectories, vocab=VOCAB, min_len=5, max_len=24, dropped_fraction=0.15)


def mesh_4():
    return build_meshes(MeshConfig(colocated=True, fsdp=2, tensor=2)).train_mesh


def mesh_1():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))


def grads_agree_on_one_and_four_devices(cfg):
    """The update's loss and gradients for a model of `cfg` (random, seed 2) on 10 random trajectories, on one
    device and on a 2 x 2 mesh: asserts they agree; returns the one-device gradients by path (numpy)."""
    trajs = random_trajectories(10, vocab=cfg.vocab_size, min_len=5, max_len=40, seed=3)
    tc = TrainerConfig(micro_batch_tokens=64, logits_chunk=16)
    want_loss, want = Trainer(random_model(cfg, seed=2), tc, mesh_1()).loss_and_grads(trajs)
    got_loss, got = Trainer(random_model(cfg, seed=2), tc, mesh_4()).loss_and_grads(trajs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert tree_rel_err(jax.device_get(got), jax.device_get(want)) < 1e-5
    return {jax.tree_util.keystr(p): np.asarray(g) for p, g in jax.tree_util.tree_flatten_with_path(want)[0]}


def tree_rel_err(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return max(
        float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / max(np.linalg.norm(np.asarray(y)), 1e-30))
        for x, y in zip(la, lb)
    )


@pytest.mark.slow
def test_update_on_4_devices_matches_one_device():
    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=48, logits_chunk=16, weight_decay=0.01)
    trajs = make_trajs(10, seed=1)
    model = random_model(tiny_config(), seed=3)
    one = Trainer(model, cfg, mesh_1())
    four = Trainer(model, cfg, mesh_4())
    before = jax.device_get(one.params)
    m1, m4 = one.update(trajs), four.update(trajs)
    p1, p4 = jax.device_get(one.params), jax.device_get(four.params)
    assert tree_rel_err(p4, p1) < 1e-5
    assert tree_rel_err(p1, before) > 1e-4  # the update did move the params
    assert m1["n_tokens"] == m4["n_tokens"] and abs(m1["loss"] - m4["loss"]) < 1e-5
    # The params live on the 4-device mesh, sharded by the model's logical axes.
    leaf = jax.tree.leaves(four.params)[0]
    assert len(leaf.sharding.device_set) == 4
    assert four.version == 1 and one.version == 1


@pytest.mark.slow
def test_update_with_blocked_attention_rows_on_4_devices_matches_one_device():
    # Rows of 384 tokens take the blocked attention path (its run-time block skipping included), whose
    # skip decision spans the rows of every device; the sharded update must still equal one device's.
    from areal_jax.models.blocked_attention import attention_block

    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=768, logits_chunk=64)
    trajs = make_trajs(12, seed=5, max_len=300)
    assert attention_block(layout.row_length(max(t.packed_len for t in trajs), 768)) == 128
    model = random_model(tiny_config(), seed=4)
    one, four = Trainer(model, cfg, mesh_1()), Trainer(model, cfg, mesh_4())
    before = jax.device_get(one.params)
    m1, m4 = one.update(trajs), four.update(trajs)
    p1, p4 = jax.device_get(one.params), jax.device_get(four.params)
    assert tree_rel_err(p4, p1) < 1e-5
    assert tree_rel_err(p1, before) > 1e-4
    assert abs(m1["loss"] - m4["loss"]) < 1e-5


def padded_reference(model, ref_model, trajs, cfg, behav_weight_cap=None):
    """Objective of the whole batch from per-sequence padded rows and rl.losses on [N, C] arrays."""
    n = len(trajs)
    width = max(t.tokens.size for t in trajs)
    c_max = max(t.completion_len for t in trajs)
    tokens = np.zeros((n, width), np.int32)
    gather = np.zeros((n, c_max), np.int32)
    targets = np.zeros((n, c_max), np.int32)
    behav = np.zeros((n, c_max), np.float32)
    adv = np.zeros((n, c_max), np.float32)
    mask = np.zeros((n, c_max), np.float32)
    for i, t in enumerate(trajs):
        tokens[i, : t.tokens.size] = t.tokens
        c = t.completion_len
        gather[i, :c] = np.arange(t.prompt_len - 1, t.tokens.size - 1)
        targets[i, :c] = t.tokens[t.prompt_len:]
        behav[i, :c] = t.behav_logp
        adv[i, :c] = t.completion_advantages()
        mask[i, :c] = t.completion_mask()

    def completion_logits(m):
        logits = m(jnp.asarray(tokens))  # [N, width, V]: one sequence per row, padding at the end
        return jnp.take_along_axis(logits, jnp.asarray(gather)[..., None], axis=1)

    def logp_of(logits):
        return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(targets)[..., None], -1)[..., 0]

    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    prox = jax.lax.stop_gradient(logp_of(completion_logits(model)))
    ref_logp = logp_of(completion_logits(ref_model)) if ref_model is not None else None

    def objective(p):
        logits = completion_logits(nnx.merge(graphdef, p, other))
        logp = logp_of(logits)
        loss, _ = decoupled_ppo_loss(
            logp, prox, behav, adv, mask, eps_clip=cfg.eps_clip, behav_weight_cap=behav_weight_cap,
            agg=cfg.loss_agg,
        )
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * aggregate(token_entropy(logits, mask), mask, cfg.loss_agg)
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * kl_penalty(logp, ref_logp, mask, estimator=cfg.kl_estimator, agg=cfg.loss_agg)
        return loss

    loss, grads = jax.value_and_grad(objective)(params)
    return float(loss), grads


@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_agg="token-mean"),
        dict(loss_agg="seq-mean-token-mean", entropy_coef=0.05, kl_coef=0.1, kl_estimator="k3"),
        dict(loss_agg="seq-mean-token-sum", behav_weight_cap=1.2),
    ],
    ids=["token-mean", "seq-mean-token-mean+entropy+kl", "seq-mean-token-sum+cap"],
)
def test_packed_microbatches_match_padded_reference(overrides):
    cfg = TrainerConfig(micro_batch_tokens=40, logits_chunk=8, **overrides)
    model = random_model(tiny_config(), seed=5)
    ref_model = random_model(tiny_config(), seed=6) if cfg.kl_coef else None
    trajs = make_trajs(9, seed=2)
    # Behaviour log-probs near the model's own, so importance weights straddle the cap.
    trainer = Trainer(model, cfg, mesh_4(), ref_model=ref_model)
    rng = np.random.default_rng(7)
    for t, lp in zip(trajs, trainer.compute_logprobs(trajs)):
        t.behav_logp = (lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
    loss, grads = trainer.loss_and_grads(trajs)
    ref_loss, ref_grads = padded_reference(model, ref_model, trajs, cfg, cfg.behav_weight_cap)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert tree_rel_err(jax.device_get(grads), ref_grads) < 1e-5


@pytest.mark.parametrize("poison", ["nan_advantage", "inf_logprob"])
def test_non_finite_batch_is_skipped(poison):
    cfg = TrainerConfig(lr=1e-2, micro_batch_tokens=64)
    trainer = Trainer(random_model(tiny_config(), seed=0), cfg, mesh_4())
    trajs = make_trajs(6, seed=3)
    bad = trajs[2]
    bad.loss_mask = np.ones(bad.completion_len, np.float32)
    if poison == "nan_advantage":
        bad.advantage = float("nan")
    else:
        bad.behav_logp[0] = -np.inf
    before = jax.device_get(trainer.state)
    metrics = trainer.update(trajs)
    after = jax.device_get(trainer.state)
    for x, y in zip(jax.tree.leaves((before.params, before.opt_state)), jax.tree.leaves((after.params, after.opt_state))):
        np.testing.assert_array_equal(x, y)
    assert metrics["skipped_updates"] == 1.0 and int(after.skipped_updates) == 1
    assert int(after.step) == 0 and trainer.version == 1
    # A clean batch afterwards is applied again.
    trainer.update(make_trajs(6, seed=3, version=1))  # same shapes: no new compile
    assert int(jax.device_get(trainer.state.step)) == 1
    assert int(jax.device_get(trainer.state.skipped_updates)) == 1


def test_non_finite_values_on_masked_tokens_do_not_skip():
    trainer = Trainer(random_model(tiny_config(), seed=0), TrainerConfig(lr=1e-2, micro_batch_tokens=64), mesh_4())
    trajs = make_trajs(4, seed=8)
    t = trajs[0]
    t.loss_mask = np.zeros(t.completion_len, np.float32)
    t.loss_mask[-1] = 1.0
    t.behav_logp[0] = np.nan
    t.token_advantages = np.full(t.completion_len, np.inf, np.float32)
    t.token_advantages[-1] = 0.5
    metrics = trainer.update(trajs)
    assert metrics["skipped_updates"] == 0.0 and int(jax.device_get(trainer.state.step)) == 1


@pytest.mark.slow
def test_eta_zero_decoupled_equals_plain_ppo():
    """Behaviour = proximal (fresh data): decoupled PPO (recompute and loglinear) equals PPO."""
    model = random_model(tiny_config(), seed=11)
    trajs = make_trajs(8, seed=12)
    base = dict(lr=1e-3, micro_batch_tokens=48, eps_clip=0.1)
    ppo = Trainer(model, TrainerConfig(loss="ppo", **base), mesh_4())
    for t, lp in zip(trajs, ppo.compute_logprobs(trajs)):
        t.behav_logp = lp  # the sampler ran the current params (version 0 = trainer version)
    decoupled = Trainer(model, TrainerConfig(loss="decoupled", prox_mode="recompute", **base), mesh_4())
    loglinear = Trainer(model, TrainerConfig(loss="decoupled", prox_mode="loglinear", **base), mesh_4())
    m_ppo = ppo.update(trajs)
    for other in (decoupled, loglinear):
        m = other.update(trajs)
        assert tree_rel_err(jax.device_get(other.params), jax.device_get(ppo.params)) < 1e-6
        assert m["loss"] == pytest.approx(m_ppo["loss"], rel=1e-5, abs=1e-7)
        assert m["behav_weight_mean"] == pytest.approx(1.0, abs=1e-5)
