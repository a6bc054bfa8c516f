"""The one aggregation (token weights, segment means) and the per-token loss forms against python loops
and against the aggregated API."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.rl import aggregation as G
from areal_jax.rl import losses as L
from tests.test_rl_losses import AGGS, random_batch, ref_aggregate


def test_token_weights_hand_numbers():
    mask = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]], np.float32)
    # 4 valid tokens; 2 rows with a valid token, holding 3 and 1 of them.
    np.testing.assert_allclose(np.asarray(G.token_weights(mask, "token-mean")),
                               [[0.25, 0.25, 0, 0.25], [0, 0, 0, 0], [0.25, 0, 0, 0]])
    np.testing.assert_allclose(np.asarray(G.token_weights(mask, "seq-mean-token-mean")),
                               [[1 / 6, 1 / 6, 0, 1 / 6], [0, 0, 0, 0], [0.5, 0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(G.token_weights(mask, "seq-mean-token-sum")),
                               [[0.5, 0.5, 0, 0.5], [0, 0, 0, 0], [0.5, 0, 0, 0]])
    for agg in AGGS:
        assert float(G.token_weights(np.zeros((2, 3)), agg).sum()) == 0.0
    with pytest.raises(ValueError, match="agg"):
        G.token_weights(mask, "mean")


@pytest.mark.parametrize("agg", AGGS)
def test_aggregate_is_the_weighted_sum_and_matches_reference(agg):
    rng = np.random.default_rng(1)
    per = rng.normal(size=(5, 7))
    mask = rng.random((5, 7)) < 0.6
    mask[2] = False
    per_nan = np.where(mask, per, np.nan)  # masked positions may hold anything
    with jax.enable_x64(True):
        got = float(G.aggregate(jnp.asarray(per_nan), jnp.asarray(mask), agg))
        weighted = float(jnp.sum(G.token_weights(mask, agg, jnp.float64) * jnp.asarray(per)))
    want = ref_aggregate(per.tolist(), mask.tolist(), agg)
    assert got == pytest.approx(want, rel=1e-12)
    assert weighted == pytest.approx(want, rel=1e-12)


def test_segment_mean_against_loop():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 10))
    seg = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 0, 0], [1] * 10, [2, 2, 1, 1, 1, 1, 0, 0, 0, 0]])
    mask = (rng.random((3, 10)) < 0.7) & (seg > 0)
    want = np.zeros_like(x)
    for i in range(3):
        for s in set(seg[i].tolist()) - {0}:
            sel = (seg[i] == s) & mask[i]
            if sel.any():
                want[i, sel] = x[i, sel].mean()
    with jax.enable_x64(True):
        got = np.asarray(G.segment_mean(jnp.asarray(x), jnp.asarray(mask), jnp.asarray(seg)))
        rows = np.asarray(G.segment_mean(jnp.asarray(x), jnp.asarray(mask)))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for i in range(3):  # without segment ids a row is one sequence
        np.testing.assert_allclose(rows[i, mask[i]], x[i, mask[i]].mean(), rtol=1e-12)
        assert np.all(rows[i, ~mask[i]] == 0)


POLICY_OPTS = dict(eps_clip=0.1, eps_clip_high=0.28, behav_weight_cap=1.5, dual_clip=2.0)


@pytest.mark.parametrize("agg", AGGS)
def test_per_token_forms_aggregate_to_the_aggregated_api(agg):
    logp, prox, behav, adv, mask = (jnp.asarray(a) for a in random_batch(4, 4, 5))
    with jax.enable_x64(True):
        logp, prox, behav, adv = (a.astype(jnp.float64) for a in (logp, prox, behav, adv))
        cases = [
            (L.decoupled_ppo_token_loss(logp, prox, behav, adv, mask, **POLICY_OPTS),
             L.decoupled_ppo_loss(logp, prox, behav, adv, mask, agg=agg, **POLICY_OPTS)),
            (L.gspo_token_loss(logp, prox, behav, adv, mask, **POLICY_OPTS),
             L.gspo_loss(logp, prox, behav, adv, mask, agg=agg, **POLICY_OPTS)),
            (L.ppo_token_loss(logp, prox, adv, mask, eps_clip=0.2),
             L.ppo_loss(logp, prox, adv, mask, eps_clip=0.2, agg=agg)),
        ]
        for (per, token_stats), (loss, stats) in cases:
            assert per.shape == mask.shape and all(v.shape == mask.shape for v in token_stats.values())
            assert float(G.aggregate(per, mask, agg)) == pytest.approx(float(loss), rel=1e-12, abs=1e-15)
            assert np.all(np.asarray(per)[~np.asarray(mask)] == 0)
            for k, v in L.policy_stats(token_stats, mask).items():
                assert float(v) == pytest.approx(float(stats[k]), rel=1e-12, abs=1e-15), k
        kl = L.kl_token_penalty(logp, prox, mask, estimator="k2")
        assert float(G.aggregate(kl, mask, agg)) == pytest.approx(
            float(L.kl_penalty(logp, prox, mask, estimator="k2", agg=agg)), rel=1e-12)
        vals, tstats = L.value_token_loss(logp, prox, adv, mask, value_clip=0.1)
        vloss, vstats = L.value_loss(logp, prox, adv, mask, value_clip=0.1, agg=agg)
        assert float(G.aggregate(vals, mask, agg)) == pytest.approx(float(vloss), rel=1e-12)
        assert float(G.masked_mean(tstats["value_clipped"], mask)) == pytest.approx(
            float(vstats["value_clip_fraction"]))


def test_packed_gspo_token_loss_equals_gspo_on_the_unpacked_rows():
    """Three sequences packed into one row with segment ids give the per-token values (and gradients)
    of gspo on one row per sequence."""
    logp, prox, behav, adv, mask = random_batch(6, 3, 4, spread=0.2, p_valid=0.8)
    mask[:, 0] = True  # every sequence has a valid token
    lengths = [4, 3, 2]  # sequence i uses its first lengths[i] columns
    for i, n in enumerate(lengths):
        mask[i, n:] = False
    with jax.enable_x64(True):
        args = [jnp.asarray(a) for a in (logp, prox, behav, adv)]
        m = jnp.asarray(mask)
        cols = [(i, t) for i, n in enumerate(lengths) for t in range(n)]
        rows_i = np.array([c[0] for c in cols])
        cols_t = np.array([c[1] for c in cols])

        def pack(a, fill=0.0):
            out = jnp.full((1, 12), fill, a.dtype)
            return out.at[0, : len(cols)].set(a[rows_i, cols_t])

        seg = jnp.zeros((1, 12), jnp.int32).at[0, : len(cols)].set(jnp.asarray(rows_i + 1, jnp.int32))
        opts = dict(eps_clip=0.05, behav_weight_cap=2.0, dual_clip=3.0)

        def unpacked(lp):
            return L.gspo_token_loss(lp, *args[1:], m, **opts)[0]

        def packed(lp):
            return L.gspo_token_loss(pack(lp), *(pack(a) for a in args[1:]), pack(m, False),
                                     segment_ids=seg, **opts)[0]

        want = np.asarray(unpacked(args[0]))[rows_i, cols_t]
        got = np.asarray(packed(args[0]))[0, : len(cols)]
        np.testing.assert_allclose(got, want, rtol=1e-12)
        w = jnp.asarray(np.random.default_rng(0).random((3, 4)))
        g_unpacked = jax.grad(lambda lp: jnp.sum(unpacked(lp) * w))(args[0])
        g_packed = jax.grad(lambda lp: jnp.sum(packed(lp) * pack(w)))(args[0])
        np.testing.assert_allclose(np.asarray(g_packed), np.asarray(g_unpacked), rtol=1e-10, atol=1e-14)
        assert np.any(np.asarray(g_unpacked) != 0)
