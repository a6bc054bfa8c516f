"""Losses of areal_jax.rl.losses against a float64 python-loop reference, hand-worked cases and
finite differences."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_jax.rl import losses as L

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
# A few fixed shapes keep eager dispatch cached; the masks vary freely within them.
SHAPES = [(1, 1), (1, 6), (4, 5)]


# ----------------------------------------------------------------------------------------------
# Independent reference: python scalars, one token at a time, float64.
# ----------------------------------------------------------------------------------------------
def ref_aggregate(per, mask, agg):
    rows = []
    total, count = 0.0, 0
    for i in range(len(per)):
        s, c = 0.0, 0
        for t in range(len(per[i])):
            if mask[i][t]:
                s += per[i][t]
                c += 1
        total, count = total + s, count + c
        if c:
            rows.append(s / c if agg == "seq-mean-token-mean" else s)
    if agg == "token-mean":
        return total / count if count else 0.0
    return sum(rows) / len(rows) if rows else 0.0


def ref_policy_loss(logp, prox, behav, adv, mask, *, eps_clip, eps_clip_high, behav_weight_cap,
                    behav_weight_mode, dual_clip, agg, sequence_ratio=False):
    hi = 1 + (eps_clip if eps_clip_high is None else eps_clip_high)
    lo = 1 - eps_clip
    B, T = len(logp), len(logp[0])
    per = [[0.0] * T for _ in range(B)]
    n = clipped = dual = dropped = 0
    w_sum, w_max, kl_sum = 0.0, 0.0, 0.0
    for i in range(B):
        diffs = [logp[i][t] - prox[i][t] for t in range(T) if mask[i][t]]
        seq_ratio = math.exp(sum(diffs) / len(diffs)) if diffs else 1.0
        for t in range(T):
            if not mask[i][t]:
                continue
            r = seq_ratio if sequence_ratio else math.exp(logp[i][t] - prox[i][t])
            w = math.exp(prox[i][t] - behav[i][t])
            a = adv[i][t]
            rc = min(max(r, lo), hi)
            tok = -min(r * a, rc * a)
            if rc * a < r * a:
                clipped += 1
            if dual_clip is not None and a < 0 and tok > dual_clip * -a:
                tok = dual_clip * -a
                dual += 1
            weight = w
            if behav_weight_cap is not None:
                if behav_weight_mode == "mask" and w > behav_weight_cap:
                    weight = 0.0
                    dropped += 1
                elif behav_weight_mode == "clamp":
                    weight = min(w, behav_weight_cap)
            per[i][t] = weight * tok
            n += 1
            w_sum += w
            w_max = max(w_max, w)
            x = prox[i][t] - logp[i][t]
            kl_sum += math.exp(x) - x - 1
    frac = (lambda k: k / n if n else 0.0)
    stats = dict(clip_fraction=frac(clipped), dual_clip_fraction=frac(dual),
                 behav_weight_mean=w_sum / n if n else 0.0, behav_weight_max=w_max,
                 masked_fraction=frac(dropped), approx_kl=kl_sum / n if n else 0.0)
    return ref_aggregate(per, mask, agg), stats


def random_batch(seed, B, T, spread=0.4, p_valid=0.7):
    rng = np.random.default_rng(seed)
    logp = -np.abs(rng.normal(1.0, 0.7, (B, T)))
    prox = logp + rng.normal(0, spread, (B, T))
    behav = prox + rng.normal(0, 2 * spread, (B, T))
    adv = rng.normal(0, 1, (B, T))
    mask = rng.random((B, T)) < p_valid
    if B > 1:
        mask[rng.integers(B)] = False  # one row with no valid token
    return logp, prox, behav, adv, mask


option_sets = st.fixed_dictionaries(dict(
    eps_clip=st.sampled_from([0.1, 0.2]),
    eps_clip_high=st.sampled_from([None, 0.28]),
    behav_weight_cap=st.sampled_from([None, 1.2, 3.0]),
    behav_weight_mode=st.sampled_from(["mask", "clamp"]),
    dual_clip=st.sampled_from([None, 1.5, 3.0]),
    agg=st.sampled_from(AGGS),
))


@pytest.mark.parametrize("loss_name", ["decoupled", "gspo"])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from(SHAPES), opts=option_sets,
       float_mask=st.booleans())
def test_policy_losses_match_reference(loss_name, seed, shape, opts, float_mask):
    B, T = shape
    logp, prox, behav, adv, mask = random_batch(seed, B, T)
    fn = L.decoupled_ppo_loss if loss_name == "decoupled" else L.gspo_loss
    want, want_stats = ref_policy_loss(logp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(),
                                       mask.tolist(), sequence_ratio=loss_name == "gspo", **opts)
    with jax.enable_x64(True):
        m = jnp.asarray(mask, jnp.float64) if float_mask else jnp.asarray(mask)
        got, stats = fn(jnp.asarray(logp), jnp.asarray(prox), jnp.asarray(behav), jnp.asarray(adv), m,
                        **opts)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(float(got), want, rtol=1e-6, atol=1e-6)
        for k, v in want_stats.items():
            np.testing.assert_allclose(float(stats[k]), v, rtol=1e-6, atol=1e-6, err_msg=k)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from(SHAPES),
       eps_clip_high=st.sampled_from([None, 0.28]), dual_clip=st.sampled_from([None, 2.0]),
       agg=st.sampled_from(AGGS))
def test_ppo_loss_matches_reference(seed, shape, eps_clip_high, dual_clip, agg):
    B, T = shape
    logp, old, _, adv, mask = random_batch(seed, B, T)
    opts = dict(eps_clip=0.2, eps_clip_high=eps_clip_high, dual_clip=dual_clip, agg=agg)
    want, _ = ref_policy_loss(logp.tolist(), old.tolist(), old.tolist(), adv.tolist(), mask.tolist(),
                              behav_weight_cap=None, behav_weight_mode="mask", **opts)
    with jax.enable_x64(True):
        got, stats = L.ppo_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv),
                                jnp.asarray(mask), **opts)
        np.testing.assert_allclose(float(got), want, rtol=1e-6, atol=1e-6)
        if mask.any():
            assert float(stats["behav_weight_mean"]) == pytest.approx(1.0)


def test_hand_worked_ppo_and_decoupled_agree():
    # ratios 1.5, 0.5, 1.1 with advantages 1, -1, 2 and eps 0.2:
    # token 0: min(1.5, 1.2) * 1 -> -1.2 ; token 1: min(-0.5, -0.8) -> +0.8 ; token 2: -2.2
    old = jnp.array([[-1.0, -2.0, -0.5]])
    logp = old + jnp.log(jnp.array([[1.5, 0.5, 1.1]]))
    adv = jnp.array([[1.0, -1.0, 2.0]])
    mask = jnp.ones((1, 3))
    want = (-1.2 + 0.8 - 2.2) / 3
    ppo, ppo_stats = L.ppo_loss(logp, old, adv, mask)
    dec, dec_stats = L.decoupled_ppo_loss(logp, old, old, adv, mask, behav_weight_cap=2.0)
    assert float(ppo) == pytest.approx(want, abs=1e-6)
    assert float(dec) == pytest.approx(want, abs=1e-6)
    assert float(ppo_stats["clip_fraction"]) == pytest.approx(2 / 3)
    assert float(dec_stats["masked_fraction"]) == 0.0
    # Dual clip at 3 on a token with ratio 5 and A = -1: loss min(5 * 1, 3 * 1) = 3.
    big = L.ppo_loss(old[:, :1] + jnp.log(5.0), old[:, :1], -jnp.ones((1, 1)), jnp.ones((1, 1)),
                     dual_clip=3.0)
    assert float(big[0]) == pytest.approx(3.0, rel=1e-6)
    assert float(big[1]["dual_clip_fraction"]) == 1.0


def test_gradient_inside_clip_range_is_minus_w_u_a_over_count():
    rng = np.random.default_rng(3)
    B, T = 3, 5
    with jax.enable_x64(True):
        prox = jnp.asarray(-np.abs(rng.normal(1, 0.5, (B, T))))
        logp = prox + jnp.asarray(rng.uniform(-0.05, 0.05, (B, T)))  # |log u| < 0.05: inside 0.8..1.2
        behav = prox + jnp.asarray(rng.normal(0, 0.5, (B, T)))
        adv = jnp.asarray(rng.normal(0, 1, (B, T)))
        mask = jnp.asarray(rng.random((B, T)) < 0.7)
        grad = jax.grad(lambda lp: L.decoupled_ppo_loss(lp, prox, behav, adv, mask)[0])(logp)
        w = jnp.exp(prox - behav)
        u = jnp.exp(logp - prox)
        want = jnp.where(mask, -w * u * adv / mask.sum(), 0.0)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-10, atol=1e-12)


def test_capped_token_contributes_nothing_in_mask_mode():
    prox = jnp.full((1, 4), -1.0)
    logp = prox + jnp.array([[0.05, -0.05, 0.1, 0.0]])
    behav = prox - jnp.array([[0.0, 0.0, 0.0, 3.0]])  # token 3: w = e^3 > cap 5
    adv = jnp.array([[1.0, -0.5, 2.0, 7.0]])
    mask = jnp.ones((1, 4))
    fn = lambda lp, a: L.decoupled_ppo_loss(lp, prox, behav, a, mask, behav_weight_cap=5.0)  # noqa
    loss, stats = fn(logp, adv)
    u = np.exp([0.05, -0.05, 0.1])
    assert float(loss) == pytest.approx(-(u * np.array([1.0, -0.5, 2.0])).sum() / 4, rel=1e-5)
    assert float(stats["masked_fraction"]) == pytest.approx(0.25)
    loss2, _ = fn(logp, adv.at[0, 3].set(-100.0))
    assert float(loss2) == float(loss)
    grad = jax.grad(lambda lp: fn(lp, adv)[0])(logp)
    assert float(grad[0, 3]) == 0.0 and np.all(np.asarray(grad[0, :3]) != 0.0)
    # Clamp mode keeps the token with weight 5.
    loss_c, _ = L.decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=5.0,
                                     behav_weight_mode="clamp")
    assert float(loss_c) == pytest.approx(float(loss) - 5.0 * 1.0 * 7.0 / 4, rel=1e-5)


def test_all_masked_and_garbage_padding_give_finite_zero():
    B, T = 2, 3
    nan = jnp.full((B, T), jnp.nan)
    for fn in (L.decoupled_ppo_loss, L.gspo_loss):
        for agg in AGGS:
            loss, stats = fn(nan, nan, nan, nan, jnp.zeros((B, T)), agg=agg, behav_weight_cap=2.0)
            assert float(loss) == 0.0
            assert all(np.isfinite(float(v)) for v in stats.values())
    # Non-finite values at masked positions leave loss and gradient finite.
    logp = jnp.array([[-1.0, -0.5, jnp.nan], [-2.0, jnp.inf, -jnp.inf]])
    prox = jnp.array([[-1.1, -0.4, jnp.nan], [-1.9, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
    adv = jnp.ones((B, T))
    for fn in (L.decoupled_ppo_loss, L.gspo_loss):
        grad = jax.grad(lambda lp: fn(lp, prox, prox, adv, mask)[0])(logp)
        assert np.all(np.isfinite(np.asarray(grad)))
    assert np.isfinite(float(L.kl_penalty(logp, prox, mask)))


def central_diff(f, x, h=1e-6):
    f = jax.jit(f)
    x = np.asarray(x, np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (float(f(jnp.asarray(xp))) - float(f(jnp.asarray(xm)))) / (2 * h)
    return g


@pytest.mark.parametrize("case", [
    ("decoupled", dict()),
    ("decoupled", dict(behav_weight_cap=2.0, dual_clip=2.0, agg="seq-mean-token-mean")),
    ("decoupled", dict(behav_weight_cap=1.5, behav_weight_mode="clamp", agg="seq-mean-token-sum")),
    ("gspo", dict(eps_clip=0.05, behav_weight_cap=3.0)),
    ("gspo", dict(agg="seq-mean-token-mean", dual_clip=3.0)),
    ("ppo", dict(eps_clip_high=0.28)),
])
def test_policy_loss_grad_matches_finite_differences(case):
    name, opts = case
    logp, prox, behav, adv, mask = random_batch(11, 3, 4, spread=0.3)
    with jax.enable_x64(True):
        args = [jnp.asarray(a) for a in (prox, behav, adv, mask)]
        if name == "decoupled":
            f = lambda lp: L.decoupled_ppo_loss(lp, *args, **opts)[0]  # noqa
        elif name == "gspo":
            f = lambda lp: L.gspo_loss(lp, *args, **opts)[0]  # noqa
        else:
            f = lambda lp: L.ppo_loss(lp, args[0], args[2], args[3], **opts)[0]  # noqa
        grad = np.asarray(jax.grad(f)(jnp.asarray(logp)))
        np.testing.assert_allclose(grad, central_diff(f, logp), rtol=1e-5, atol=1e-8)
        assert np.any(grad != 0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("agg", AGGS)
def test_kl_penalty_reference_and_grad(estimator, agg):
    rng = np.random.default_rng(5)
    logp = -np.abs(rng.normal(1, 0.5, (3, 4)))
    ref = logp + rng.normal(0, 0.4, (3, 4))
    mask = rng.random((3, 4)) < 0.7
    per = []
    for i in range(3):
        row = []
        for t in range(4):
            d = logp[i, t] - ref[i, t]
            row.append({"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[estimator])
        per.append(row)
    with jax.enable_x64(True):
        f = lambda lp: L.kl_penalty(lp, jnp.asarray(ref), jnp.asarray(mask), estimator=estimator,  # noqa
                                    agg=agg)
        np.testing.assert_allclose(float(f(jnp.asarray(logp))), ref_aggregate(per, mask, agg),
                                   rtol=1e-10)
        np.testing.assert_allclose(np.asarray(jax.grad(f)(jnp.asarray(logp))), central_diff(f, logp),
                                   rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("value_clip", [None, 0.2])
@pytest.mark.parametrize("agg", AGGS)
def test_value_loss_reference_and_grad(value_clip, agg):
    rng = np.random.default_rng(7)
    values, old, returns = (rng.normal(0, 1, (3, 4)) for _ in range(3))
    mask = rng.random((3, 4)) < 0.7
    per = []
    for i in range(3):
        row = []
        for t in range(4):
            e1 = (values[i, t] - returns[i, t]) ** 2
            if value_clip is None:
                row.append(0.5 * e1)
                continue
            delta = max(-value_clip, min(value_clip, values[i, t] - old[i, t]))
            e2 = (old[i, t] + delta - returns[i, t]) ** 2
            row.append(0.5 * max(e1, e2))
        per.append(row)
    with jax.enable_x64(True):
        f = lambda v: L.value_loss(v, jnp.asarray(old), jnp.asarray(returns), jnp.asarray(mask),  # noqa
                                   value_clip=value_clip, agg=agg)[0]
        np.testing.assert_allclose(float(f(jnp.asarray(values))), ref_aggregate(per, mask, agg),
                                   rtol=1e-10)
        np.testing.assert_allclose(np.asarray(jax.grad(f)(jnp.asarray(values))),
                                   central_diff(f, values), rtol=1e-5, atol=1e-8)


def test_token_entropy_and_logprobs():
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 3, (2, 3, 7))
    tokens = rng.integers(0, 7, (2, 3))
    mask = np.array([[1, 1, 0], [1, 0, 1]], bool)
    z = logits - logits.max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ent_ref = np.where(mask, -(np.exp(logsm) * logsm).sum(-1), 0.0)
    lp_ref = np.take_along_axis(logsm, tokens[..., None], -1)[..., 0]
    with jax.enable_x64(True):
        x = jnp.asarray(logits)
        np.testing.assert_allclose(np.asarray(L.token_entropy(x, jnp.asarray(mask))), ent_ref,
                                   rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(np.asarray(L.token_logprobs(x, jnp.asarray(tokens))), lp_ref,
                                   rtol=1e-10)
        f = lambda y: L.token_entropy(y, jnp.asarray(mask)).sum()  # noqa
        np.testing.assert_allclose(np.asarray(jax.grad(f)(x)), central_diff(f, logits), rtol=1e-5,
                                   atol=1e-8)
        g = lambda y: L.token_logprobs(y, jnp.asarray(tokens)).sum()  # noqa
        np.testing.assert_allclose(np.asarray(jax.grad(g)(x)), central_diff(g, logits), rtol=1e-5,
                                   atol=1e-8)
    # bfloat16 logits are computed in float32; -inf logits (banned tokens) give finite entropy.
    bf = jnp.asarray(logits, jnp.bfloat16)
    assert L.token_logprobs(bf, jnp.asarray(tokens)).dtype == jnp.float32
    banned = jnp.asarray(logits, jnp.float32).at[..., 0].set(-jnp.inf)
    ent = L.token_entropy(banned, jnp.ones((2, 3)))
    z2 = np.asarray(banned, np.float64)[..., 1:]
    p = np.exp(z2 - z2.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(ent), -(p * np.log(p)).sum(-1), rtol=1e-5)


def test_losses_jit_and_reject_bad_options():
    logp, prox, behav, adv, mask = (jnp.asarray(a, jnp.float32) for a in random_batch(1, 2, 3))
    jitted = jax.jit(lambda *a: L.decoupled_ppo_loss(*a, behav_weight_cap=2.0, agg="seq-mean-token-sum"))
    eager = L.decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=2.0,
                                 agg="seq-mean-token-sum")
    assert float(jitted(logp, prox, behav, adv, mask)[0]) == pytest.approx(float(eager[0]), rel=1e-5)
    with pytest.raises(ValueError, match="agg"):
        L.decoupled_ppo_loss(logp, prox, behav, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="behav_weight_mode"):
        L.decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_mode="cap")
    with pytest.raises(ValueError, match="dual_clip"):
        L.ppo_loss(logp, prox, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="estimator"):
        L.kl_penalty(logp, prox, mask, estimator="k4")
