"""Critic PPO (train.critic=value_head): values on the policy trunk, GAE targets in the trainer against a
hand computation on unpacked rows, the packed objective against the pure rl API, the value loss going
down, and the value head's place in the train state (checkpointed, never in the sampler's params)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.checkpoint import Checkpointer
from areal_jax.rl import losses as L
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.trainer import Trainer, TrainerConfig
from areal_jax.trainer.state import replicated
from tests.test_trainer import make_trajs, mesh_4, tree_rel_err
from tests.test_trainer_losses import unpacked_arrays


def gae_loop(rewards, values, mask, gamma, lam):
    """Per row, backwards over the valid tokens only (python floats)."""
    adv = np.zeros_like(values, dtype=np.float64)
    for i in range(values.shape[0]):
        running, next_value = 0.0, 0.0
        for t in reversed(np.flatnonzero(mask[i]).tolist()):
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            running = delta + gamma * lam * running
            adv[i, t] = running
            next_value = values[i, t]
    return adv, np.where(mask > 0, adv + values, 0.0)


def critic_trainer(cfg, seed=5, head_seed=0):
    model = random_model(tiny_config(), seed=seed)
    trainer = Trainer(model, cfg, mesh_4())
    if head_seed is not None:  # a non-zero head, so values (and GAE) are not trivially 0
        rng = np.random.default_rng(head_seed)
        d = trainer.state.value_head["kernel"].shape[0]
        head = {"kernel": jnp.asarray(rng.normal(0, 0.3, (d, 1)), jnp.float32),
                "bias": jnp.asarray([0.1], jnp.float32)}
        trainer.state = dataclasses.replace(trainer.state, value_head=jax.device_put(head, replicated(trainer.mesh)))
    return model, trainer


def with_rewards(trajs, seed):
    rng = np.random.default_rng(seed)
    for t in trajs:
        t.reward = float(rng.integers(0, 2))
        t.advantage = 123.0  # group advantages are ignored when the critic is on
    return trajs


def hand_targets(model, head, trajs, cfg):
    """Values from the unpacked model (one trajectory per row), GAE by a python loop."""
    a = unpacked_arrays(trajs)
    graphdef, params, other = nnx.split(model, nnx.Param, ...)

    def values_of(p, hd):
        h = nnx.merge(graphdef, p, other).hidden(jnp.asarray(a["tokens"]))
        h = jnp.take_along_axis(h, jnp.asarray(a["gather"])[..., None], axis=1)
        return (h.astype(jnp.float32) @ hd["kernel"])[..., 0] + hd["bias"][0]

    values = np.asarray(values_of(params, head), np.float64)
    rewards = np.zeros_like(values)
    for i, t in enumerate(trajs):
        valid = np.flatnonzero(a["mask"][i])
        rewards[i, valid[-1]] = t.reward
    adv, ret = gae_loop(rewards, values, a["mask"], cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:  # over every valid token of the batch; the returns keep their scale
        valid = adv[a["mask"] > 0]
        adv = np.where(a["mask"] > 0, (adv - valid.mean()) / (valid.std() + 1e-8), 0.0)
    return a, values, adv, ret, values_of


@pytest.mark.parametrize("whiten", [True, False])
def test_trainer_gae_targets_and_objective_match_hand_computation(whiten):
    cfg = TrainerConfig(critic="value_head", gamma=0.9, lam=0.8, value_coef=0.7, value_clip=0.05,
                        micro_batch_tokens=40, logits_chunk=8, loss_agg="seq-mean-token-mean",
                        whiten_advantages=whiten)
    model, trainer = critic_trainer(cfg)
    trajs = with_rewards(make_trajs(9, seed=2), seed=3)
    head = jax.device_get(trainer.state.value_head)
    a, values, adv, ret, values_of = hand_targets(model, head, trajs, cfg)

    got_values, got_adv, got_ret = trainer.critic_targets(trajs)
    for i, t in enumerate(trajs):
        c, m = t.completion_len, a["mask"][i, : t.completion_len] > 0
        np.testing.assert_allclose(got_values[i], values[i, :c], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_adv[i][m], adv[i, :c][m], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got_ret[i][m], ret[i, :c][m], rtol=1e-4, atol=1e-5)
        assert np.all(got_adv[i][~m] == 0)
    assert np.abs(adv).max() > 0.1  # a non-trivial case

    # The packed objective: decoupled PPO on the GAE advantages + value_coef * clipped value loss, the
    # value clipped around the update-start values; gradients reach the trunk and the head.
    rng = np.random.default_rng(7)
    for t, lp in zip(trajs, trainer.compute_logprobs(trajs)):
        t.behav_logp = (lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
    a = unpacked_arrays(trajs)
    graphdef, params, other = nnx.split(model, nnx.Param, ...)

    def logp_of(p):
        logits = nnx.merge(graphdef, p, other)(jnp.asarray(a["tokens"]))
        logits = jnp.take_along_axis(logits, jnp.asarray(a["gather"])[..., None], axis=1)
        return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(a["targets"])[..., None], -1)[..., 0]

    prox = jax.lax.stop_gradient(logp_of(params))

    def objective(train):
        p, hd = train
        pg, _ = L.decoupled_ppo_loss(logp_of(p), prox, a["behav"], jnp.asarray(adv, jnp.float32), a["mask"],
                                     agg=cfg.loss_agg)
        vl, _ = L.value_loss(values_of(p, hd), jnp.asarray(values, jnp.float32), jnp.asarray(ret, jnp.float32),
                             a["mask"], value_clip=cfg.value_clip, agg=cfg.loss_agg)
        return pg + cfg.value_coef * vl

    want, want_grads = jax.value_and_grad(objective)((params, head))
    loss, grads = trainer.loss_and_grads(trajs)
    assert loss == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert tree_rel_err(jax.device_get(grads), want_grads) < 1e-4
    assert float(jnp.abs(grads[1]["kernel"]).max()) > 0


def test_one_update_lowers_the_value_loss_on_a_fixed_batch():
    # gamma = lam = 1: the returns are the rewards whatever the values, so the targets stay fixed.
    cfg = TrainerConfig(critic="value_head", gamma=1.0, lam=1.0, value_coef=1.0, value_clip=None, lr=3e-3,
                        micro_batch_tokens=40, logits_chunk=8)
    _, trainer = critic_trainer(cfg, head_seed=None)  # the zero-initialised head: values start at 0
    trajs = with_rewards(make_trajs(8, seed=4), seed=5)
    values0, _, returns0 = trainer.critic_targets(trajs)
    assert all(np.all(v == 0) for v in values0)
    masks = [t.completion_mask() > 0 for t in trajs]

    def error(values, returns):
        return np.mean(np.concatenate([(v - r)[m] ** 2 for v, r, m in zip(values, returns, masks)]))

    metrics = trainer.update(trajs)
    assert metrics["value_error"] == pytest.approx(error(values0, returns0), rel=1e-5)
    assert metrics["value_loss"] == pytest.approx(0.5 * error(values0, returns0), rel=1e-5)
    values1, _, returns1 = trainer.critic_targets(trajs)
    for r0, r1, m in zip(returns0, returns1, masks):
        np.testing.assert_allclose(r1[m], r0[m], rtol=1e-6, atol=1e-6)
    assert error(values1, returns1) < 0.95 * error(values0, returns0)  # measured: 0.74 -> 0.67


def test_value_head_is_checkpointed_and_kept_from_the_sampler(tmp_path):
    cfg = TrainerConfig(critic="value_head", lr=1e-3, micro_batch_tokens=40, logits_chunk=8)
    model, first = critic_trainer(cfg, head_seed=None)
    trajs = with_rewards(make_trajs(6, seed=1), seed=1)
    first.update(trajs)
    # The sampler gets Trainer.params: the model's params only, the structure of nnx.split(model).
    assert jax.tree.structure(first.params) == jax.tree.structure(nnx.split(model, nnx.Param, ...)[1])
    assert float(jnp.abs(first.state.value_head["kernel"]).max()) > 0  # the head was trained
    ckpt = Checkpointer(str(tmp_path / "run"))
    ckpt.save(first.version, first.state, {"version": first.version})
    _, second = critic_trainer(cfg, head_seed=None)
    second.state, _ = ckpt.restore(ckpt.latest_step(), second.state)
    ckpt.close()
    saved, restored = jax.device_get(first.state), jax.device_get(second.state)
    np.testing.assert_array_equal(saved.value_head["kernel"], restored.value_head["kernel"])
    for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    m1, m2 = first.update(trajs), second.update(trajs)
    assert m1["value_loss"] == m2["value_loss"] and m1["loss"] == m2["loss"]


def test_critic_advantages_drive_the_policy_like_given_token_advantages():
    """value_coef 0: a critic update (two minibatches, KL to a reference) moves the policy exactly as a
    plain update given the critic's GAE advantages as token advantages."""
    base = dict(lr=1e-3, micro_batch_tokens=40, logits_chunk=8, ppo_minibatches=2, kl_coef=0.1, gamma=0.95, lam=0.9)
    model, ref = random_model(tiny_config(), seed=8), random_model(tiny_config(), seed=9)
    critic = Trainer(model, TrainerConfig(critic="value_head", value_coef=0.0, **base), mesh_4(), ref_model=ref)
    rng = np.random.default_rng(1)
    d = critic.state.value_head["kernel"].shape[0]
    head = {"kernel": rng.normal(0, 0.3, (d, 1)).astype(np.float32), "bias": np.zeros((1,), np.float32)}
    critic.state = dataclasses.replace(critic.state, value_head=jax.device_put(head, replicated(critic.mesh)))
    trajs = with_rewards(make_trajs(8, seed=6), seed=2)
    _, advantages, _ = critic.critic_targets(trajs)
    given = [dataclasses.replace(t, token_advantages=a) for t, a in zip(with_rewards(make_trajs(8, seed=6), seed=2),
                                                                         advantages)]
    plain = Trainer(model, TrainerConfig(**base), mesh_4(), ref_model=ref)
    m_critic, m_plain = critic.update(trajs), plain.update(given)
    assert m_critic["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-7)
    assert m_critic["kl"] == pytest.approx(m_plain["kl"], rel=1e-5, abs=1e-9) and m_plain["kl"] > 0
    assert tree_rel_err(jax.device_get(critic.params), jax.device_get(plain.params)) < 1e-5
    np.testing.assert_array_equal(jax.device_get(critic.state.value_head)["kernel"], head["kernel"])


def test_critic_options_are_checked_with_the_key_to_fix():
    from areal_jax.knobs import ConfigError

    for bad, pattern in [(dict(critic="gae"), r"--config\.train\.critic"), (dict(lam=1.5), r"--config\.train\.lam=1\.5"),
                         (dict(gamma=-0.1), r"--config\.train\.gamma=-0\.1"),
                         (dict(value_coef=-1.0), r"--config\.train\.value_coef=-1\.0"),
                         (dict(value_clip=0.0), r"--config\.train\.value_clip=0\.0")]:
        with pytest.raises(ConfigError, match=pattern):
            TrainerConfig(**bad)
    trainer = Trainer(random_model(tiny_config(), seed=0), TrainerConfig(micro_batch_tokens=40), mesh_4())
    assert trainer.state.value_head is None  # critic="none" (the default) adds nothing to the state
    with pytest.raises(ValueError, match="train.critic=value_head"):
        trainer.critic_targets(make_trajs(2))


def test_critic_with_lora_trains_adapters_and_head_and_leaves_the_base_frozen():
    """train.critic=value_head beside LoRA: the head trains with the adapters, the frozen base stays bit-equal,
    the value loss falls, and the targets are still GAE over the adapted model's values."""
    from areal_jax.models.lora import LoRAConfig, apply_lora

    model = random_model(tiny_config(), seed=5)
    apply_lora(model, LoRAConfig(enabled=True, rank=4, alpha=8.0), rngs=nnx.Rngs(0))
    base_before = jax.device_get(nnx.split(model, nnx.LoRAParam, ...)[2])
    cfg = TrainerConfig(critic="value_head", lr=3e-3, micro_batch_tokens=40, logits_chunk=8, gamma=1.0, lam=1.0)
    trainer = Trainer(model, cfg, mesh_4(), wrt=nnx.LoRAParam)
    trajs = with_rewards(make_trajs(6, seed=1), seed=1)
    head0 = jax.device_get(trainer.state.value_head)
    lora0 = jax.device_get(trainer.state.params)
    losses = [trainer.update(trajs)["value_loss"] for _ in range(6)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.6 * losses[0], losses
    head1, lora1 = jax.device_get(trainer.state.value_head), jax.device_get(trainer.state.params)
    assert not np.array_equal(head0["kernel"], head1["kernel"])
    assert jax.tree.structure(lora0) == jax.tree.structure(lora1)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(lora0), jax.tree.leaves(lora1)))
    assert jax.tree.structure(base_before) == jax.tree.structure(jax.device_get(trainer._other))
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(jax.device_get(trainer._other))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # gamma = lam = 1 and a single terminal reward: every valid token's return is the trajectory's reward.
    _, _, returns = trainer.critic_targets(trajs)
    for t, r in zip(trajs, returns):
        np.testing.assert_allclose(r[np.asarray(t.loss_mask, bool) if t.loss_mask is not None else slice(None)],
                                   t.reward, atol=1e-6)
