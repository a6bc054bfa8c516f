"""Advantage estimators and reward shaping against hand-worked numbers and numpy loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.rl import advantages as A


def test_gae_hand_worked_three_steps():
    # gamma 0.9, lam 0.8, reward 1 at the last of three tokens, one padding token after the end.
    # t=2: delta = 1 - 0.7 = 0.3                     A2 = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03            A1 = 0.03 + 0.72 * 0.3 = 0.246
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04            A0 = 0.04 + 0.72 * 0.246 = 0.21712
    rewards = jnp.array([[0.0, 0.0, 1.0, 5.0]])
    values = jnp.array([[0.5, 0.6, 0.7, 9.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    adv, ret = A.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(np.asarray(adv), [[0.21712, 0.246, 0.3, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), [[0.71712, 0.846, 1.0, 0.0]], rtol=1e-6)


def gae_numpy(rewards, values, mask, gamma, lam):
    adv = np.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[i, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            running = delta + gamma * lam * running
            adv[i, t] = running
            next_value = values[i, t]
    return adv, np.where(mask, adv + values, 0.0)


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_numpy_loop(seed):
    rng = np.random.default_rng(seed)
    B, T = 4, 9
    rewards = rng.normal(size=(B, T))
    values = rng.normal(size=(B, T))
    lengths = rng.integers(0, T + 1, B)
    mask = np.arange(T)[None] < lengths[:, None]  # padding after the end
    if seed % 2:
        mask &= rng.random((B, T)) < 0.8  # masked spans inside a sequence are skipped
    gamma, lam = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)][seed]
    want_adv, want_ret = gae_numpy(rewards, values, mask, gamma, lam)
    with jax.enable_x64(True):
        adv, ret = jax.jit(lambda r, v, m: A.gae(r, v, m, gamma=gamma, lam=lam))(
            jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=1e-10, atol=1e-12)


def test_group_advantages_against_numpy():
    rng = np.random.default_rng(0)
    g, n = 5, 4
    r = rng.integers(0, 3, g * n).astype(np.float64) * 0.5
    grp = r.reshape(g, n)
    with jax.enable_x64(True):
        got = {m: np.asarray(A.group_advantages(jnp.asarray(r), n, mode=m)).reshape(g, n)
               for m in ("grpo", "dr_grpo", "rloo")}
    for k in range(g):
        row = grp[k]
        same = np.all(row == row[0])
        want_grpo = np.zeros(n) if same else (row - row.mean()) / (row.std() + 1e-6)
        np.testing.assert_allclose(got["grpo"][k], want_grpo, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got["dr_grpo"][k], row - row.mean(), atol=1e-12)
        loo = [row[j] - np.delete(row, j).mean() for j in range(n)]
        np.testing.assert_allclose(got["rloo"][k], loo, atol=1e-12)
        assert abs(got["rloo"][k].sum()) < 1e-12  # RLOO advantages sum to zero per group


def test_identical_rewards_give_exact_zeros():
    r = jnp.array([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.0])
    for mode in ("grpo", "dr_grpo", "rloo"):
        adv = np.asarray(A.group_advantages(r, 3, mode=mode))
        assert np.all(np.isfinite(adv))
        assert np.all(adv[:6] == 0.0), mode
        assert adv[6] > 0 > adv[7]
    assert np.all(np.asarray(A.group_advantages(jnp.array([1.0, 0.0]), 1)) == 0.0)


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        A.group_advantages(jnp.zeros(7), 4)
    with pytest.raises(ValueError, match="rloo"):
        A.group_advantages(jnp.zeros(4), 1, mode="rloo")
    with pytest.raises(ValueError, match="mode"):
        A.group_advantages(jnp.zeros(4), 2, mode="ppo")


def test_overlong_penalty_hand_numbers():
    # max_len 100, buffer 20: free up to 80, -0.5 at 90, -1 from 100 on (times the factor).
    lengths = jnp.array([10, 80, 85, 90, 100, 130])
    np.testing.assert_allclose(np.asarray(A.overlong_penalty(lengths, 100, 20)),
                               [0.0, 0.0, -0.25, -0.5, -1.0, -1.0], atol=1e-7)
    np.testing.assert_allclose(np.asarray(A.overlong_penalty(lengths, 100, 20, 0.5))[3], -0.25)
    with pytest.raises(ValueError, match="buffer_len"):
        A.overlong_penalty(lengths, 100, 0)
