"""Trainer.warm_up: the update's programs compiled for the seed shape before any batch, so an update packed in
that shape compiles none of them, with every option that adds a program or a field (proximal forward, critic,
KL reference, loglinear)."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from jax import monitoring
from jax.sharding import Mesh

from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig
from areal_jax.trainer.warmup import seed_shape

COMPILES = collections.Counter()  # jitted function name -> backend compiles in this process


def _count(name, secs, **kw):
    if name.endswith("backend_compile_duration"):
        COMPILES[kw.get("fun_name", "?")] += 1


monitoring.register_event_duration_secs_listener(_count)
UPDATE_PROGRAMS = ("jit(forward)", "jit(accumulate)", "jit(apply)", "jit(zero_grads)", "jit(zero_metric_sums)")


def _mesh():
    import jax

    devices = jax.devices()[:2]
    return Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tensor"))


@pytest.mark.parametrize("options", [
    dict(prox_mode="recompute"),
    dict(prox_mode="loglinear", ppo_minibatches=2),
    dict(critic="value_head", kl_coef=0.1),
    dict(prox_mode="loglinear", arch="qwen3_moe"),  # its metric sums hold the router's counts too
    dict(arch="qwen3_moe", router_replay="replay"),  # its micro-steps hold the sampler's routes too
], ids=["recompute", "loglinear", "critic_kl", "moe", "moe_replay"])
def test_an_update_in_the_warmed_shape_compiles_none_of_its_programs(options):
    # A model and budget no other test uses, so nothing of this shape is compiled in the process already.
    options = dict(options)
    model_cfg = tiny_config(options.pop("arch", "qwen2"))
    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=200, logits_chunk=16, new_shape_cost=1e9, **options)
    ref = random_model(model_cfg, seed=3) if options.get("kl_coef") else None
    trainer = Trainer(random_model(model_cfg, seed=3), cfg, _mesh(), ref_model=ref)
    assert seed_shape(29, 200) == (32, 6)  # rows of 32 (holding 29 tokens), as many as 200 tokens hold
    assert trainer.warm_up(29) is None
    assert trainer.layouts.compiled == {(32, 6)}
    before = {k: COMPILES[k] for k in UPDATE_PROGRAMS}
    assert before["jit(accumulate)"] >= 1 and before["jit(apply)"] >= 1
    trajs = random_trajectories(12, vocab=model_cfg.vocab_size, seed=1, min_len=8, max_len=30)
    if cfg.router_replay != "off":  # two expert layers, two of four experts per token
        rng = np.random.default_rng(3)
        for t in trajs:
            t.routes = np.stack([rng.permutation(4)[:2] for _ in range(2 * len(t.tokens))]).reshape(-1, 2, 2)
    metrics = trainer.update(trajs)
    assert trainer.layouts.compiled == {(32, 6)}  # packed in the warmed shape
    assert metrics["compiled_shapes"] == 1 and metrics["micro_steps"] >= 1 and np.isfinite(metrics["loss"])
    assert {k: COMPILES[k] for k in UPDATE_PROGRAMS} == before
    assert ("moe_max_load" in metrics) == (model_cfg.num_experts > 0)
    assert ("moe_route_agreement" in metrics) == (cfg.router_replay != "off")


def test_a_background_warm_up_records_the_shape_at_once_and_compiles_in_a_thread():
    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=136, logits_chunk=16, prox_mode="loglinear")
    trainer = Trainer(random_model(tiny_config(), seed=4), cfg, _mesh())
    accumulate = COMPILES["jit(accumulate)"]
    thread = trainer.warm_up(40, background=True)
    assert trainer.layouts.compiled == {(48, 2)}  # before the thread has compiled anything
    thread.join(timeout=300)
    assert not thread.is_alive() and COMPILES["jit(accumulate)"] == accumulate + 1
