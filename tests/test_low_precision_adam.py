"""train.moment_dtype=bfloat16 (trainer/low_precision.py): AdamW's moments stored in bfloat16 by stochastic rounding.

References: the rounding against its definition (unbiased, never more than one bfloat16 step from the value, exact
values kept); the optimizer against optax's float32 AdamW (the same first step; over 1,500 steps of a regression the
same loss and moments within a few percent, where a second moment rounded to nearest drifts by a third); the job's
memory plan against what a Trainer allocates (half the moments' bytes) on a sharded mesh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from areal_jax import config as config_lib
from areal_jax.checkpoint import Checkpointer
from areal_jax.knobs import ConfigError
from areal_jax.runtime.mesh import build_meshes
from areal_jax.system import memory as job_memory
from areal_jax.testing import models as testing
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig, make_optimizer
from areal_jax.trainer.low_precision import (
    LowPrecisionAdamState,
    random_bits,
    scale_by_adam_stochastic,
    stochastic_round,
)
from areal_jax.trainer.memory import resident_bytes


def test_the_random_bits_are_uniform_and_new_each_step_and_leaf():
    bits = np.asarray(random_bits((600, 500), jnp.int32(7), 3))
    counts = np.bincount((bits >> 28).ravel(), minlength=16)  # the top bits, which the rounding reads
    expected = bits.size / 16
    assert ((counts - expected) ** 2 / expected).sum() < 45  # chi-square, 15 degrees of freedom: p ~ 1e-4
    for shift in (24, 16, 12, 8):  # the top bits of each half: the second moment's and (shifted up) the first's
        nibble = np.bincount(((bits >> shift) & 0xF).ravel(), minlength=16)
        assert ((nibble - expected) ** 2 / expected).sum() < 45
    assert np.array_equal(bits, np.asarray(random_bits((600, 500), jnp.int32(7), 3)))  # the same on every run
    for other in (random_bits((600, 500), jnp.int32(8), 3), random_bits((600, 500), jnp.int32(7), 4)):
        assert np.mean(np.asarray(other) == bits) < 1e-3
    assert len(np.unique(bits)) > 0.99 * bits.size


def test_the_random_bits_of_a_sharded_leaf_are_the_whole_leafs():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tensor"))
    got = jax.jit(lambda s: random_bits((64, 48), s, 5), out_shardings=sharding)(jnp.int32(3))
    assert len(got.sharding.device_set) == 4
    np.testing.assert_array_equal(np.asarray(got), np.asarray(random_bits((64, 48), jnp.int32(3), 5)))


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    x = jnp.asarray(np.random.default_rng(0).standard_normal(4000).astype(np.float32) * 10.0 ** np.linspace(-6, 3, 4000))
    below = x.astype(jnp.bfloat16).astype(jnp.float32)  # nearest; the two bfloat16 neighbours of x bracket it
    step = jnp.abs(x) * 2.0**-7  # at least one bfloat16 step at x's magnitude
    n = 2048
    draws = jax.jit(jax.vmap(lambda s: stochastic_round(x, random_bits(x.shape, s, 0)).astype(jnp.float32)))(
        jnp.arange(n))
    assert float(jnp.max(jnp.abs(draws - x) / step)) <= 1.0
    assert bool(jnp.all(jnp.sign(draws) == jnp.sign(x)))
    total = draws.sum(0)
    bias = np.asarray(jnp.abs(total / n - x) / step)
    assert bias.mean() < 0.01 and bias.max() < 0.05  # sampling noise of n draws: ~0.5 / sqrt(n) of a step at most
    nearest = np.asarray(jnp.abs(below - x) / step)
    assert nearest.mean() > 0.1  # rounding to nearest is off by a tenth of a step on average, every time
    exact = jnp.asarray([0.0, 1.0, -2.5, 3.0e-20, 65280.0], jnp.bfloat16).astype(jnp.float32)  # stay as they are
    np.testing.assert_array_equal(np.asarray(stochastic_round(exact, random_bits(exact.shape, 1, 0))), exact)
    odd = jnp.asarray([jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    got = np.asarray(stochastic_round(odd, random_bits(odd.shape, 1, 0)).astype(jnp.float32))
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2])


def regression(tx: optax.GradientTransformation, steps: int = 1500) -> tuple[dict, object, float]:
    """`steps` minibatches of a least-squares regression (256 x 64 inputs, 8 outputs); returns (params, state,
    final loss on the whole set)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
    y = x @ jnp.asarray(rng.standard_normal((64, 8)), jnp.float32) + 0.1 * jnp.asarray(rng.standard_normal((256, 8)),
                                                                                         jnp.float32)

    def loss(p, rows):
        return jnp.mean((x[rows] @ p["w"] + p["b"] - y[rows]) ** 2)

    @jax.jit
    def run(p):
        def step(carry, i):
            p, s = carry
            g = jax.grad(loss)(p, (jnp.arange(32) + 32 * i) % 256)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, s), _ = jax.lax.scan(step, (p, tx.init(p)), jnp.arange(steps))
        return p, s

    p, s = run({"w": jnp.zeros((64, 8)), "b": jnp.zeros((8,))})
    return p, s, float(loss(p, jnp.arange(256)))


def nearest_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """The same step with moments rounded to the nearest bfloat16: what stochastic rounding avoids."""
    def init(p):
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.bfloat16), p)
        return LowPrecisionAdamState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update(g, s, p=None):
        c = s.count + 1
        m = jax.tree.map(lambda m, g: b1 * m.astype(jnp.float32) + (1 - b1) * g, s.mu, g)
        v = jax.tree.map(lambda v, g: b2 * v.astype(jnp.float32) + (1 - b2) * g * g, s.nu, g)
        t = c.astype(jnp.float32)
        u = jax.tree.map(lambda m, v: (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), m, v)
        keep = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (m, v))
        return u, LowPrecisionAdamState(c, *keep)

    return optax.GradientTransformation(init, update)


def test_the_first_step_is_adamws_and_the_moments_are_bfloat16():
    cfg = TrainerConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2)
    params = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.float32), "b": jnp.ones(4)}
    grads = jax.tree.map(lambda p: 0.3 * p + 0.01, params)
    want, _ = make_optimizer(cfg, 10).update(grads, make_optimizer(cfg, 10).init(params), params)
    tx = make_optimizer(TrainerConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2, moment_dtype="bfloat16"), 10)
    got, state = tx.update(grads, tx.init(params), params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    adam = [s for s in state if isinstance(s, LowPrecisionAdamState)][0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert int(adam.count) == 1


def test_bfloat16_moments_follow_float32_adams_where_rounding_to_nearest_drifts():
    lr = 1e-3
    want, want_state, want_loss = regression(optax.adam(lr))
    got, got_state, got_loss = regression(optax.chain(scale_by_adam_stochastic(), optax.scale_by_learning_rate(lr)))
    _, near_state, near_loss = regression(optax.chain(nearest_adam(), optax.scale_by_learning_rate(lr)))
    nu = np.asarray(want_state[0].nu["w"])

    def drift(state):
        return float(np.mean(np.abs(np.asarray(state[0].nu["w"], np.float32) - nu) / nu))

    assert drift(got_state) < 0.06 and drift(near_state) > 0.2
    assert got_loss == pytest.approx(want_loss, rel=0.01) and near_loss > want_loss * 1.01
    assert float(jnp.max(jnp.abs(got["w"] - want["w"]))) < 0.05


def test_the_plan_counts_half_the_moments_and_a_sharded_trainer_holds_them(tmp_path):
    cfg = testing.tiny_config(num_layers=2, vocab_size=256, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    parts = {}
    for dtype in ("float32", "bfloat16"):
        job = config_lib.from_config_dict({"rollout": {"num_slots": 8, "max_len": 96},
                                           "train": {"moment_dtype": dtype, "micro_batch_tokens": 128},
                                           "data": {"max_prompt_len": 32}})
        meshes = build_meshes(job.mesh)
        build = job_memory.model_builder(None, 0)
        parts[dtype] = job_memory.state_parts(job, cfg, meshes, build)[0]
    f32, bf16, params = parts["float32"]["optimizer"], parts["bfloat16"]["optimizer"], parts["float32"]["params"]
    assert abs(f32 - 2 * params) <= 16 and abs(bf16 - params) <= 16  # two moments a parameter (+ step counts)

    assert meshes.train_mesh.shape["fsdp"] == 2  # 4 CPU devices: two train, two rollout
    trainer = Trainer(build(cfg), job.train, meshes.train_mesh)
    assert 0 <= resident_bytes(trainer.state.opt_state) - parts["bfloat16"]["optimizer"] <= 16  # + the step count
    adam = [s for s in trainer.state.opt_state if isinstance(s, LowPrecisionAdamState)][0]
    for mu, p in zip(jax.tree.leaves(adam.mu), jax.tree.leaves(trainer.state.params)):
        assert mu.dtype == jnp.bfloat16 and mu.sharding == p.sharding  # moments follow their params
    before = jax.device_get(trainer.state.params)
    metrics = trainer.update(random_trajectories(8, vocab=cfg.vocab_size, min_len=5, max_len=24, seed=1))
    assert np.isfinite(metrics["loss"])
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(jax.device_get(trainer.state.params)), jax.tree.leaves(before)))
    assert moved > 0

    saved = Checkpointer(str(tmp_path))  # bfloat16 moments round-trip; restored as float32 ones they are refused
    # here (trainer.resume converts them: tests/test_moment_resume.py)
    saved.save(1, trainer.state, {})
    state, _ = saved.restore(1, trainer.state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    other = Trainer(build(cfg), TrainerConfig(micro_batch_tokens=128), meshes.train_mesh)
    with pytest.raises(ValueError, match="train.moment_dtype"):
        saved.restore(1, other.state)
    saved.close()
    with pytest.raises(ConfigError, match="moment_dtype"):
        config_lib.from_config_dict({"train": {"moment_dtype": "float16"}})
