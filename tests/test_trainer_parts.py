"""Pieces of the trainer against hand-worked numbers and direct references: packing layout, aggregation
weights, schedule, loglinear proximal log-probs, chunked log-probs, staleness filtering, config errors."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.rl.packing import balanced_microbatches
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.trainer import Trainer, TrainerConfig, Trajectory, make_schedule
from areal_jax.trainer.batch import aggregation_weights, effective_masks, pack_steps, split_minibatches
from areal_jax.trainer.layout import _row_sizes, row_counts, row_length, step_layout
from areal_jax.trainer.logprobs import chunked_logprobs
from areal_jax.trainer.update import loglinear_prox


def traj(tokens, prompt_len, version=0, **kw):
    c = len(tokens) - prompt_len
    kw.setdefault("behav_logp", -np.arange(1, c + 1, dtype=np.float32))
    kw.setdefault("versions", np.full(c, version))
    return Trajectory(tokens=np.array(tokens), prompt_len=prompt_len, **kw)


def test_pack_layout_shifts_targets_per_segment():
    a = traj([10, 11, 12, 13], 2, advantage=0.5)  # completion 12, 13
    b = traj([20, 21, 22], 1, advantage=-1.0, loss_mask=[1, 0])  # completion 21, 22 (22 masked)
    trajs = [a, b]
    masks = [a.completion_mask(), b.completion_mask()]
    weights = aggregation_weights(masks, "token-mean")
    (step,) = pack_steps(trajs, [0, 1], masks, weights, n_devices=1, micro_batch_tokens=16, trainer_version=3)
    n = a.packed_len + b.packed_len  # 3 + 2
    assert step["tokens"].shape == (1, 16)  # rows are at least 16 long
    row = {k: v[0, :n].tolist() for k, v in step.items()}
    # Both orders are valid packings; find where a starts.
    first_is_a = row["tokens"][0] == 10
    ra, rb = (slice(0, 3), slice(3, 5)) if first_is_a else (slice(2, 5), slice(0, 2))
    get = lambda key, sl: row[key][sl]  # noqa: E731
    assert get("tokens", ra) == [10, 11, 12] and get("targets", ra) == [11, 12, 13]
    assert get("tokens", rb) == [20, 21] and get("targets", rb) == [21, 22]
    assert get("positions", ra) == [0, 1, 2] and get("positions", rb) == [0, 1]
    assert len(set(get("segment_ids", ra))) == 1 and len(set(get("segment_ids", rb))) == 1
    assert get("segment_ids", ra)[0] != get("segment_ids", rb)[0]
    # Completion token j is scored at position prompt_len + j - 1.
    assert get("mask", ra) == [0, 1, 1] and get("mask", rb) == [1, 0]
    assert get("behav_logp", ra) == [0, -1, -2] and get("behav_logp", rb) == [-1, 0]
    assert get("advantages", ra) == [0, 0.5, 0.5] and get("advantages", rb) == [-1, 0]
    np.testing.assert_allclose(get("weights", ra), [0, 1 / 3, 1 / 3], rtol=1e-6)
    assert get("versions", ra)[0] == 3 and get("seq_index", rb) == [1, 1] and get("seq_index", ra) == [-1, 0, 0]
    assert step["segment_ids"][0, n:].tolist() == [0] * (16 - n)
    assert step["mask"][0, n:].sum() == 0


def test_aggregation_weights_hand_numbers():
    masks = [np.array([1, 1, 0, 1], np.float32), np.array([0, 0], np.float32), np.array([1], np.float32)]
    tm = aggregation_weights(masks, "token-mean")
    np.testing.assert_allclose(np.concatenate(tm), [0.25, 0.25, 0, 0.25, 0, 0, 0.25])
    sm = aggregation_weights(masks, "seq-mean-token-mean")  # 2 sequences with valid tokens
    np.testing.assert_allclose(np.concatenate(sm), [1 / 6, 1 / 6, 0, 1 / 6, 0, 0, 0.5])
    ss = aggregation_weights(masks, "seq-mean-token-sum")
    np.testing.assert_allclose(np.concatenate(ss), [0.5, 0.5, 0, 0.5, 0, 0, 0.5])


def test_microsteps_are_balanced_and_lengths_bucketed():
    rng = np.random.default_rng(0)
    trajs = [traj(rng.integers(0, 50, int(n)), 1) for n in rng.integers(3, 30, 23)]
    masks = [t.completion_mask() for t in trajs]
    steps = pack_steps(trajs, range(23), masks, None, n_devices=2, micro_batch_tokens=64, trainer_version=0)
    seen = sorted(int(i) for s in steps for i in np.unique(s["seq_index"]) if i >= 0)
    assert seen == list(range(23))  # every trajectory exactly once
    # 3 steps of 2 devices x 1 row of 64 (longest is 28): 384 positions for 374 tokens; 4 steps of 2 x 1 rows of
    # 48 take as many positions in more steps, and the shortest rows that hold the longest (32) would take 4
    # steps of 2 x 2 rows, 512 positions.
    assert {s["tokens"].shape for s in steps} == {(2, 64)} and len(steps) == 3
    total = sum(t.packed_len for t in trajs)
    rows = steps[0]["tokens"].shape[0] // 2
    per_device = [sum(int((s["segment_ids"][d * rows:(d + 1) * rows] > 0).sum()) for s in steps) for d in range(2)]
    assert sum(per_device) == total and abs(per_device[0] - per_device[1]) <= 0.2 * total
    assert row_length(1, 4096) == 16 and row_length(200, 4096) == 256 and row_length(300, 4096) == 384 and row_length(300, 260) == 264
    # 1,000 tokens in rows of 256 on 2 devices need 2 rows each; 9,000 need 18, above the budget's 4.
    assert row_counts(1000, 256, 2, 1024) == [1, 2] and row_counts(9000, 256, 2, 1024) == [1, 2, 4]
    assert row_counts(40_000, 256, 1, 1 << 20) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert row_counts(68_000, 3072, 4, 16384) == [1, 2, 4, 5]  # 8 would pass the budget: 5 fills it
    with pytest.raises(ValueError, match="micro_batch_tokens=8"):
        pack_steps(trajs, range(23), masks, None, n_devices=1, micro_batch_tokens=8, trainer_version=0)
    groups = split_minibatches(trajs, 3)
    assert sorted(i for g in groups for i in g) == list(range(23)) and len(groups) == 3
    with pytest.raises(ValueError, match="ppo_minibatches=30"):
        split_minibatches(trajs, 30)


def test_schedule_hand_numbers():
    const = make_schedule(TrainerConfig(lr=1.0, warmup_steps=3))
    assert [float(const(s)) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    cos = make_schedule(TrainerConfig(lr=2.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1), 6)
    # After warm-up: lr * (alpha + (1 - alpha) * 0.5 * (1 + cos(pi * k / 4))), k = step - 2.
    expect = [2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4))) for k in range(5)]
    assert [float(cos(s)) for s in range(2, 7)] == pytest.approx(expect, rel=1e-6)
    assert float(cos(100)) == pytest.approx(0.2)


def test_loglinear_prox_hand_numbers():
    logp = jnp.array([[-1.0, -1.0, -1.0, -1.0]])
    behav = jnp.array([[-2.0, -2.0, -2.0, -3.0]])
    versions = jnp.array([[5, 4, 2, 1]])
    prox = loglinear_prox(logp, behav, versions, jnp.asarray(5))
    # alpha = (5 - vb) / (6 - vb): 0, 1/2, 3/4, 4/5.
    np.testing.assert_allclose(prox, [[-2.0, -1.5, -1.25, -3.0 + 0.8 * 2.0]], rtol=1e-6)


@pytest.mark.parametrize("cotangent", ["logp", "entropy", "both"])
def test_chunked_logprobs_match_full_logits_and_gradients(cotangent):
    key = jax.random.key(0)
    h = jax.random.normal(key, (2, 13, 8))
    w = jax.random.normal(jax.random.key(1), (8, 31))
    targets = jax.random.randint(jax.random.key(2), (2, 13), 0, 31)
    a, b = {"logp": (1.0, 0.0), "entropy": (0.0, 1.0), "both": (1.0, -0.3)}[cotangent]
    u = jax.random.normal(jax.random.key(3), (2, 13))  # a different cotangent at every position

    def full(h, w):  # autodiff through the plain formulas on the whole [B, T, V] logits
        logits = h @ w
        logp = jax.nn.log_softmax(logits)
        picked = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
        ent = -(jnp.exp(logp) * logp).sum(-1)
        return picked, ent

    lp, ent = chunked_logprobs(h, w, targets, chunk=4)  # 13 is not a multiple of 4
    lp_ref, ent_ref = full(h, w)
    np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent, ent_ref, rtol=1e-5, atol=1e-6)
    lp_only, zeros = chunked_logprobs(h, w, targets, chunk=4, with_entropy=False)
    np.testing.assert_allclose(lp_only, lp_ref, rtol=1e-5, atol=1e-6)
    assert not np.any(zeros)
    f = lambda fn: lambda h, w: jnp.sum(u * (a * fn(h, w)[0] + b * fn(h, w)[1]))  # noqa: E731
    g = jax.grad(f(lambda h, w: chunked_logprobs(h, w, targets, chunk=4)), argnums=(0, 1))(h, w)
    g_ref = jax.grad(f(full), argnums=(0, 1))(h, w)
    for x, y in zip(g, g_ref):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    if cotangent == "logp":  # the logp-only variant has the same gradient
        g2 = jax.grad(lambda h, w: jnp.sum(u * chunked_logprobs(h, w, targets, chunk=4, with_entropy=False)[0]),
                      argnums=(0, 1))(h, w)
        for x, y in zip(g2, g_ref):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_bf16_logits_backward_stays_in_bf16_and_matches_float32():
    """In bf16 compute the vocabulary projection's two backward products take bf16 operands (float32
    accumulation) instead of being promoted to float32 by the float32 cotangent, and the gradients stay
    within bf16 rounding of the float32 computation."""
    h32 = jax.random.normal(jax.random.key(0), (2, 24, 16))
    w32 = jax.random.normal(jax.random.key(1), (16, 64)) * 0.3
    targets = jax.random.randint(jax.random.key(2), (2, 24), 0, 64)
    loss = lambda h, w: chunked_logprobs(h, w, targets, chunk=8)[0].sum()  # noqa: E731
    g16 = jax.grad(loss, argnums=(0, 1))(h32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16))
    g32 = jax.grad(loss, argnums=(0, 1))(h32, w32)
    for a, b in zip(g16, g32):
        assert a.dtype == jnp.bfloat16
        rel = float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
        assert rel < 2e-2, rel
    # Every dot in the backward program has bf16 operands (float32 would mean the cotangent promoted them).
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)).as_text()
    dots = [ln for ln in hlo.splitlines() if "stablehlo.dot_general" in ln]
    assert len(dots) == 4, hlo  # the forward, its recomputation in the backward, and two backward products
    for ln in dots:
        operand_types = ln.rsplit("(", 1)[1].split(")")[0]
        assert "f32" not in operand_types, ln


def test_staleness_filter_and_metrics():
    fresh = traj([1, 2, 3, 4], 1, version=4)
    mixed = traj([1, 2, 3, 4, 5], 2, versions=np.array([1, 3, 4]))
    masks, stale = effective_masks([fresh, mixed], trainer_version=4, max_staleness=1)
    assert masks[0].tolist() == [1, 1, 1] and masks[1].tolist() == [0, 1, 1]
    assert stale.tolist() == [0, 3]
    masks, _ = effective_masks([fresh, mixed], trainer_version=4, max_staleness=None)
    assert masks[1].tolist() == [1, 1, 1]


@pytest.mark.slow
def test_compute_logprobs_match_model_and_staleness_in_update():
    from tests.test_trainer import mesh_4  # noqa: PLC0415

    model = random_model(tiny_config(), seed=2)
    cfg = TrainerConfig(micro_batch_tokens=32, logits_chunk=8, ppo_minibatches=2)
    trainer = Trainer(model, cfg, mesh_4(), max_staleness=0)
    # Row lengths are chosen with attention's cost per row position: layers x heads x head_dim / params.
    mc = tiny_config()
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    assert trainer._attention_weight == pytest.approx(mc.num_layers * mc.num_heads * mc.head_dim / n_params)
    rng = np.random.default_rng(1)
    trajs = [traj(rng.integers(3, 97, n), 2, version=v) for n, v in [(9, 0), (14, 0), (7, 0), (20, 0)]]
    got = trainer.compute_logprobs(trajs)
    for t, lp in zip(trajs, got):
        logits = model(jnp.asarray(t.tokens)[None])[0]
        ref = jax.nn.log_softmax(logits)[np.arange(t.prompt_len - 1, len(t.tokens) - 1), t.tokens[t.prompt_len:]]
        np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=1e-5)
    m = trainer.update(trajs)
    assert m["n_tokens"] == sum(t.completion_len for t in trajs) and m["staleness_max"] == 0
    assert int(jax.device_get(trainer.state.step)) == 2  # two PPO minibatches: two optimizer steps
    # Version is now 1: with max_staleness=0 the version-0 tokens are all dropped.
    trajs[0].versions[:] = 1
    m = trainer.update(trajs)
    assert m["n_tokens"] == trajs[0].completion_len and m["staleness_max"] == 1
    assert m["stale_dropped_fraction"] == pytest.approx(1 - trajs[0].completion_len / sum(t.completion_len for t in trajs))
    assert trainer.version == 2
    # The minibatch without valid tokens applies no step and is not counted as skipped.
    assert int(jax.device_get(trainer.state.step)) == 3 and m["skipped_updates"] == 0


def test_config_and_input_errors():
    with pytest.raises(ValueError, match="prox_mode='exact' is not one of"):
        TrainerConfig(prox_mode="exact")
    with pytest.raises(ValueError, match="dual_clip=0.5 must be greater than 1"):
        TrainerConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="must exceed train.warmup_steps=10"):
        make_schedule(TrainerConfig(schedule="cosine", warmup_steps=10), 10)
    with pytest.raises(ValueError, match="behav_logp has 2 entries but the completion has 3 tokens"):
        Trajectory(tokens=np.arange(5), prompt_len=2, behav_logp=np.zeros(2), versions=np.zeros(3))
    with pytest.raises(ValueError, match="at least one prompt token"):
        Trajectory(tokens=np.arange(3), prompt_len=3, behav_logp=np.zeros(0), versions=np.zeros(0))


def _layout_cost(lengths, row_len, per_device, n_devices, attention_weight, overhead):
    rows = balanced_microbatches(lengths, row_len, n_devices * per_device)
    return len(rows) // (n_devices * per_device) * (per_device * row_len * (1 + attention_weight * row_len) + overhead)


@pytest.mark.parametrize("seed", range(8))
def test_step_layout_takes_the_cheapest_layout(seed):
    """Against every row length with every number of rows per device the budget allows that is a power of two or
    fills the budget, each packed by hand: the chosen layout costs the least (positions and micro-steps), the
    shorter rows and then the more rows on a tie, and never more than the rows per device the rule before took
    (the power of two that holds the minibatch in one micro-step, or the budget's most); it holds each
    trajectory once, within its rows and a whole number of micro-steps within the budget."""
    rng = np.random.default_rng(seed)
    n_devices = int(rng.choice([1, 2, 4]))
    budget = int(rng.choice([256, 512, 2048]))
    lengths = [int(x) for x in rng.integers(8, 100, int(rng.integers(5, 60)))]
    weight = float(rng.choice([0.0, 1e-3, 1e-2]))
    overhead = int(rng.choice([0, 64, 256]))
    row_len, per_device, rows = step_layout(lengths, n_devices, budget, weight, overhead)
    costs = {(r, k): _layout_cost(lengths, r, k, n_devices, weight, overhead)
             for r in _row_sizes(max(lengths), budget) for k in range(1, budget // r + 1)
             if k & (k - 1) == 0 or k == budget // r}
    best = min(costs.values())
    assert costs[(row_len, per_device)] == best
    assert (row_len, -per_device) == min((r, -k) for (r, k), c in costs.items() if c == best)
    for r in _row_sizes(max(lengths), budget):
        needed = -(-(-(-sum(lengths) // r)) // n_devices)
        before = min(budget // r, 1 << (needed - 1).bit_length())
        assert best <= _layout_cost(lengths, r, before, n_devices, weight, overhead)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= row_len for row in rows)
    assert len(rows) % (n_devices * per_device) == 0 and per_device * row_len <= budget


def test_step_layout_fills_the_last_micro_step():
    """A minibatch of 128 trajectories like a GSM8K run's (prompts of 100-199 tokens, log-normal completions of
    median 300, at most 1,024): 68,478 tokens on 4 devices under a budget of 16,384. The rule before took as many
    rows per device as one micro-step needs, capped at the budget: two micro-steps of 4 x 2 rows of 6,144, the
    second mostly padding (70% of the positions real). Three micro-steps of 4 x 4 rows of 1,536 hold them at 93%."""
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(100, 200, 128) + np.minimum(1024, rng.lognormal(np.log(300), 0.8, 128)
                                                                        .astype(int) + 1)]
    assert (sum(lengths), max(lengths)) == (68_478, 1_209)
    before = balanced_microbatches(lengths, 6144, 4 * 2)
    assert len(before) == 2 * 4 * 2 and sum(lengths) / (len(before) * 6144) == pytest.approx(0.697, abs=1e-3)
    row_len, per_device, rows = step_layout(lengths, 4, 16384, attention_weight=4.35e-5)
    assert (row_len, per_device, len(rows)) == (1536, 4, 3 * 4 * 4)
    assert sum(lengths) / (len(rows) * row_len) == pytest.approx(0.929, abs=1e-3)


def test_step_layout_packs_the_default_jobs_minibatch_in_one_step():
    """A minibatch like the default job's (32 trajectories of 30-84 tokens, budget 2,048): rows of 96 (the
    shortest holding the longest) fit 21 per micro-step, 2,016 positions, too few for its ~1,950 tokens
    once packed, so it took two micro-steps; rows of 128 take one of 16 x 128."""
    rng = np.random.default_rng(0)
    lengths = [int(p + c - 1) for p, c in zip(rng.integers(29, 38, 32),
                                              np.clip(np.ceil(np.exp(rng.normal(np.log(24), 1.0, 32))), 2, 48))]
    assert max(lengths) > 64 and 1900 < sum(lengths) <= 2048
    shortest = row_length(max(lengths), 2048)
    assert shortest == 96
    old_rows = balanced_microbatches(lengths, 96, 2048 // 96)  # the most rows of 96 the budget holds: 21
    assert len(old_rows) * 96 == 2 * 21 * 96  # two micro-steps of 21 x 96
    row_len, per_device, rows = step_layout(lengths, 1, 2048, attention_weight=1024 / 3.2e6)
    assert (row_len, per_device, len(rows)) == (128, 16, 16)

