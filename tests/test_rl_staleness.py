"""Staleness control: the admission rule, checked by simulating an asynchronous run, and the masks."""

import random

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_jax.rl import staleness as S


def test_rollout_capacity_hand_cases():
    # (eta + v + 1) * B - (accepted + running) = (2 + 3 + 1) * 4 - (15 + 5) = 4; concurrency 8 - 5 = 3.
    assert S.rollout_capacity(3, 4, 2, 15, 5, 8) == 3
    assert S.rollout_capacity(3, 4, 2, 15, 5, None) == 4
    assert S.rollout_capacity(3, 4, None, 15, 5, 8) == 3
    assert S.rollout_capacity(0, 4, 0, 0, 0, None) == 4  # eta 0: exactly one batch at a time
    assert S.rollout_capacity(0, 4, 0, 3, 1, None) == 0
    assert S.rollout_capacity(0, 4, 0, 10, 2, 1) == 0  # floored at 0
    with pytest.raises(ValueError, match="unbounded"):
        S.rollout_capacity(0, 4, None, 0, 0, None)
    with pytest.raises(ValueError, match="batch_size"):
        S.rollout_capacity(0, 0, 1, 0, 0, None)
    with pytest.raises(ValueError, match="running"):
        S.rollout_capacity(0, 4, 1, 0, -1, None)


def simulate(rng, eta, batch, max_concurrent, n_versions, order):
    """A random interleaving of admissions, completions and training steps.

    Rollouts admitted through rollout_capacity take the current version; a completion finishes a
    random running rollout, generating tokens with the version current at that moment (interruptible
    generation: the versions along a trajectory never decrease). The trainer takes `batch` samples and
    bumps the version: with order="admission" the next `batch` samples in admission order once all of
    them are finished, with order="completion" the oldest finished ones. Returns the trained batches as
    (trainer version, [token versions of each sample]).
    """
    version, admitted, running, finished, trained = 0, [], set(), [], []
    accepted = 0
    for _ in range(100_000):
        if version == n_versions:
            return trained
        cap = S.rollout_capacity(version, batch, eta, accepted, len(running), max_concurrent)
        if order == "admission":
            head = admitted[len(trained) * batch:(len(trained) + 1) * batch]
            can_train = len(head) == batch and all(s["done"] for s in head)
        else:
            can_train = len(finished) >= batch
        actions = (["admit"] if cap > 0 else []) + (["complete"] if running else []) + (
            ["train"] if can_train else [])
        assert actions, "the run deadlocked"
        action = rng.choice(actions)
        if action == "admit":
            s = {"versions": [version], "done": False}
            admitted.append(s)
            running.add(len(admitted) - 1)
        elif action == "complete":
            idx = rng.choice(sorted(running))
            running.remove(idx)
            s = admitted[idx]
            s["versions"] += [version] * rng.randint(0, 2)
            s["done"] = True
            accepted += 1
            finished.append(s)
        else:
            if order == "admission":
                take = admitted[len(trained) * batch:(len(trained) + 1) * batch]
            else:
                finished.sort(key=lambda s: s["versions"][0])
                take = finished[:batch]
            for s in take:
                finished.remove(s)
            trained.append((version, [s["versions"] for s in take]))
            version += 1
    raise AssertionError("the simulation did not reach the target version")


@pytest.mark.parametrize("eta", [0, 1, 4])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 4),
       max_concurrent=st.sampled_from([None, 1, 3, 16]))
def test_admission_rule_bounds_staleness(eta, seed, batch, max_concurrent):
    trained = simulate(random.Random(seed), eta, batch, max_concurrent, n_versions=8,
                       order="admission")
    for version, samples in trained:
        for versions in samples:
            assert 0 <= version - versions[0] <= eta
        if eta == 0:  # synchronous RL: every sample comes from the current parameters
            assert all(v == [version] * len(v) for v in samples)
        got = S.sample_staleness(version, _pad(samples), _pad_mask(samples))
        assert np.all(np.asarray(got) <= eta)


def _pad(samples):
    T = max(len(v) for v in samples)
    return jnp.array([v + [10**6] * (T - len(v)) for v in samples])


def _pad_mask(samples):
    T = max(len(v) for v in samples)
    return jnp.array([[1] * len(v) + [0] * (T - len(v)) for v in samples], jnp.float32)


def test_completion_order_can_exceed_eta_without_the_mask():
    # Filling batches in completion order, a slow rollout can be overtaken again and again, so the
    # admission rule alone does not bound its staleness; this is why staleness_mask exists.
    worst = 0
    for seed in range(30):
        for version, samples in simulate(random.Random(seed), 1, 2, None, 8, order="completion"):
            worst = max(worst, max(version - v[0] for v in samples))
    assert worst > 1


@pytest.mark.parametrize("eta", [0, 1, 4])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 4))
def test_staleness_mask_enforces_eta_under_completion_order(eta, seed, batch):
    trained = simulate(random.Random(seed), eta, batch, None, n_versions=8, order="completion")
    for version, samples in trained:
        tokens, mask = _pad(samples), _pad_mask(samples)
        by_sample = np.asarray(S.staleness_mask(tokens, version, eta, mask, per="sample"))
        by_token = np.asarray(S.staleness_mask(tokens, version, eta, mask, per="token"))
        for i, versions in enumerate(samples):
            too_old = version - min(versions) > eta
            assert np.all(by_sample[i, :len(versions)] == (0.0 if too_old else 1.0))
            np.testing.assert_array_equal(by_token[i, :len(versions)],
                                          [float(version - v <= eta) for v in versions])
        assert np.all(np.asarray(S.sample_staleness(version, tokens, jnp.asarray(by_sample))) <= eta)


def test_sample_staleness_and_mask_hand_case():
    versions = jnp.array([[3, 3, 4, 5], [5, 5, 5, 0], [1, 2, 2, 2], [0, 0, 0, 0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(np.asarray(S.sample_staleness(5, versions, mask)), [2, 0, 3, 0])
    tok = S.staleness_mask(versions, 5, 1, mask)
    assert tok.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(tok), [[0, 0, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0],
                                                    [0, 0, 0, 0]])
    smp = S.staleness_mask(versions, 5, 2, mask.astype(jnp.float32), per="sample")
    np.testing.assert_array_equal(np.asarray(smp), [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0],
                                                    [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(S.staleness_mask(versions, 5, None, mask)),
                                  np.asarray(mask))
    with pytest.raises(ValueError, match="per"):
        S.staleness_mask(versions, 5, 1, mask, per="row")
