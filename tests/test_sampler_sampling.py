"""Sampling math against a plain numpy reference and against the law of large numbers."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.sampler.sampling import (
    SamplingParams,
    behaviour_log_probs,
    filtered_logits,
    sample_tokens,
)


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Sampling distribution of one row, written with explicit loops in float64. [V] -> [V]."""
    x = np.asarray(logits, np.float64)
    if temperature <= 0:
        e = np.exp(x - x.max())
        return e / e.sum()
    x = x / temperature
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    allowed = order[: top_k] if top_k > 0 else list(order)
    e = np.exp(np.array([x[i] for i in allowed]) - x[allowed[0]])
    pk = e / e.sum()
    kept, mass = [], 0.0
    for tok, pr in zip(allowed, pk):
        if kept and mass >= top_p:
            break
        kept.append(tok)
        mass += pr
    out = np.zeros(len(x))
    e = np.exp(np.array([x[i] for i in kept]) - x[kept[0]])
    out[kept] = e / e.sum()
    return out


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.719 is the one-sided 1e-4 normal point."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * np.sqrt(a)) ** 3


SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 5, 1.0),
    (1.0, 0, 0.6),
    (0.8, 7, 0.9),
    (1.0, 1, 1.0),
    (1.0, 0, 1e-6),
    (0.0, 3, 0.5),  # greedy ignores top-k / top-p
]


def _arrays(settings):
    t = jnp.array([s[0] for s in settings], jnp.float32)
    k = jnp.array([s[1] for s in settings], jnp.int32)
    p = jnp.array([s[2] for s in settings], jnp.float32)
    return t, k, p


def test_behaviour_log_probs_match_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(SETTINGS), 23)).astype(np.float32) * 2.0
    t, k, p = _arrays(SETTINGS)
    got = np.exp(np.asarray(jax.jit(behaviour_log_probs)(jnp.asarray(logits), t, k, p)))
    for row, (temp, top_k, top_p) in enumerate(SETTINGS):
        want = reference_distribution(logits[row], temp, top_k, top_p)
        np.testing.assert_allclose(got[row], want, atol=1e-6, err_msg=f"setting {SETTINGS[row]}")


def test_unrestricted_rows_skip_the_sort_and_equal_softmax():
    logits = jnp.array(np.random.default_rng(1).normal(size=(3, 11)), jnp.float32)
    t = jnp.array([1.0, 0.5, 2.0])
    out = filtered_logits(logits, t, jnp.zeros(3, jnp.int32), jnp.ones(3))
    np.testing.assert_allclose(np.asarray(out), np.asarray(logits) / np.asarray(t)[:, None], rtol=1e-6)


# blocks of the two-level draw: one block (the default's 1,024 > V), blocks that divide V, a padded last block, a
# block per token
BLOCKS = [1024, 4, 5, 1]


@pytest.mark.parametrize("block", BLOCKS)
def test_sampled_logprob_is_the_behaviour_logprob_and_tokens_stay_allowed(block):
    rng = np.random.default_rng(2)
    rows = SETTINGS * 8
    logits = jnp.asarray(rng.normal(size=(len(rows), 17)).astype(np.float32) * 3.0)
    t, k, p = _arrays(rows)
    table = np.asarray(behaviour_log_probs(logits, t, k, p))
    step = jax.jit(functools.partial(sample_tokens, block=block))
    key = jax.random.key(0)
    for _ in range(20):
        key, sub = jax.random.split(key)
        tokens, logp = step(logits, sub, t, k, p)
        tokens, logp = np.asarray(tokens), np.asarray(logp)
        for r, (temp, _, _) in enumerate(rows):
            if temp > 0:
                assert np.isfinite(table[r, tokens[r]]), f"row {r} emitted a filtered token"
                np.testing.assert_allclose(logp[r], table[r, tokens[r]], atol=1e-5)
            else:
                assert tokens[r] == int(np.argmax(np.asarray(logits[r])))
                raw = np.asarray(jax.nn.log_softmax(logits[r]))
                np.testing.assert_allclose(logp[r], raw[tokens[r]], atol=1e-5)


@pytest.mark.parametrize("temp,top_k,top_p,block", [(1.0, 0, 1.0, 1024), (0.8, 6, 1.0, 1024), (1.0, 0, 0.8, 1024),
                                                     (1.0, 0, 1.0, 5), (0.8, 6, 1.0, 4), (1.0, 0, 0.8, 5),
                                                     (1.0, 0, 1.0, 1)])
def test_empirical_frequencies_match_the_distribution(temp, top_k, top_p, block):
    vocab, n = 12, 40_000
    logits = np.random.default_rng(3).normal(size=(vocab,)).astype(np.float32)
    want = reference_distribution(logits, temp, top_k, top_p)
    batch = jnp.broadcast_to(jnp.asarray(logits), (n, vocab))
    tokens, _ = jax.jit(functools.partial(sample_tokens, block=block))(
        batch,
        jax.random.key(1234),
        jnp.full((n,), temp, jnp.float32),
        jnp.full((n,), top_k, jnp.int32),
        jnp.full((n,), top_p, jnp.float32),
    )
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    support = want > 0
    assert counts[~support].sum() == 0, "a token outside the top-k / top-p set was sampled"
    expected = want[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} with {df} dof"


def test_sampling_params_validation_messages():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    sp = SamplingParams(top_k=None, top_p=None, stop_token_ids=[3, 4])
    assert sp.top_k_value == 0 and sp.top_p_value == 1.0 and sp.stop_token_ids == (3, 4)


@pytest.mark.parametrize("block", BLOCKS)
def test_greedy_takes_the_first_maximum_across_blocks_and_whole_filtered_blocks_are_never_drawn(block):
    # row 0: the maximum in positions 6 and 13 (blocks apart); row 1: top-k 2 keeps positions 15 and 16 only, so
    # every earlier block holds nothing allowed
    logits = np.zeros((2, 17), np.float32)
    logits[0, [6, 13]] = 5.0
    logits[1, [15, 16]] = [3.0, 2.5]
    t, k, p = jnp.array([0.0, 1.0]), jnp.array([0, 2], jnp.int32), jnp.ones(2)
    step = jax.jit(functools.partial(sample_tokens, block=block))
    seen = set()
    for i in range(64):
        tokens, logp = step(jnp.asarray(logits), jax.random.key(i), t, k, p)
        assert int(tokens[0]) == 6
        np.testing.assert_allclose(float(logp[0]), float(jax.nn.log_softmax(jnp.asarray(logits[0]))[6]), atol=1e-5)
        seen.add(int(tokens[1]))
    assert seen == {15, 16}
