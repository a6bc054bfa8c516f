"""Auxiliary-loss-free balancing of DeepSeek-V3's routers (train.router_bias_rate, trainer.balance) and the router
statistics of sigmoid scores (routing.router_stats)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models.routing import Scoring, router_stats
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig
from areal_jax.trainer.balance import bias_layers, nudge_bias


def test_sigmoid_statistics_share_each_tokens_scores():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(7, 6)).astype(np.float32)
    mask = np.array([1, 0, 1, 1, 1, 0, 1], bool)
    got = np.asarray(router_stats(jnp.asarray(logits), 2, jnp.asarray(mask), scoring=Scoring("sigmoid")))
    scores = 1 / (1 + np.exp(-logits))
    shares = scores / scores.sum(-1, keepdims=True)
    picks = np.zeros(6)
    for row in scores[mask]:
        picks[np.argsort(-row, kind="stable")[:2]] += 1
    np.testing.assert_allclose(got[0], picks)
    np.testing.assert_allclose(got[1], shares[mask].sum(0), rtol=1e-6)
    assert got[1].sum() == pytest.approx(mask.sum(), rel=1e-6)  # each real token's shares sum to one


def test_nudge_moves_each_bias_toward_its_layers_mean():
    """Worked by hand: picks (3, 1, 2, 2) have mean 2, so the over-picked expert goes down, the under-picked up."""
    params = {"layers": {0: {"mlp": {"router_score_bias": jnp.zeros(4)}},
                         2: {"mlp": {"router_score_bias": jnp.full(4, 0.5), "router": jnp.ones((3, 4))}}}}
    counts = jnp.asarray([[3.0, 1.0, 2.0, 2.0], [0.0, 0.0, 4.0, 0.0]])
    out = nudge_bias(params, counts, 0.1, (0, 2))
    np.testing.assert_allclose(out["layers"][0]["mlp"]["router_score_bias"], [-0.1, 0.1, 0.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(out["layers"][2]["mlp"]["router_score_bias"], [0.6, 0.6, 0.4, 0.6], atol=1e-7)
    np.testing.assert_array_equal(out["layers"][2]["mlp"]["router"], params["layers"][2]["mlp"]["router"])


def _trainer(model, wrt=nnx.Param, **kw):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    return Trainer(model, TrainerConfig(micro_batch_tokens=4096, lr=1e-3, **kw), mesh, wrt=wrt)


# Both long (40-65 s in CI): `nudge_bias` is checked by hand above, and tests/test_gemma_job.py runs a DeepSeek-V3 job
# with the rate on.
@pytest.mark.parametrize("rate", [pytest.param(0.0, marks=pytest.mark.long), pytest.param(0.01, marks=pytest.mark.long)])
def test_an_update_moves_the_picking_bias_by_its_minibatchs_load(rate):
    """After one optimizer step the bias is the loaded one plus rate * sign(mean - picks), the picks counted by
    separate forwards of the starting model over the batch's input tokens; with rate 0 AdamW leaves it as loaded
    (no gradient reaches it, and it is a vector: no weight decay)."""
    cfg = tiny_config("deepseek_v3", num_layers=3)
    layers = bias_layers(cfg)
    assert layers == (1, 2)
    trajs = random_trajectories(6, vocab=cfg.vocab_size, seed=1)
    model = random_model(cfg, seed=4)
    for i in layers:  # distinct starting biases, large enough to steer some picks
        model.layers[i].mlp.router_score_bias[...] = jax.random.normal(jax.random.key(i), (cfg.num_experts,)) * 0.1
    before = [np.array(model.layers[i].mlp.router_score_bias[...]) for i in layers]
    stats = sum(np.asarray(model.hidden(jnp.asarray(t.tokens[None, :-1]), router_stats=True)[1]["stats"])
                for t in trajs)
    counts = stats[:, 0]
    assert counts.sum() == len(layers) * sum(len(t.tokens) - 1 for t in trajs) * cfg.num_experts_per_tok
    trainer = _trainer(model, router_bias_rate=rate)
    metrics = trainer.update(trajs)
    assert metrics["micro_steps"] == 1
    for j, i in enumerate(layers):
        want = before[j] + rate * np.sign(counts[j].mean() - counts[j])
        got = np.asarray(trainer.state.params["layers"][i]["mlp"]["router_score_bias"][...])
        np.testing.assert_allclose(got, want, atol=1e-7)
    if rate:
        assert np.any(np.sign(counts.mean(axis=1, keepdims=True) - counts) != 0)


def test_the_rate_needs_a_trained_bias():
    from areal_jax.models.lora import LoRAConfig, apply_lora

    cfg = tiny_config("deepseek_v3")
    model = apply_lora(random_model(cfg, seed=1), LoRAConfig(rank=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="router_bias_rate=0.01 moves the routers' picking bias.*LoRA"):
        _trainer(model, wrt=nnx.LoRAParam, router_bias_rate=0.01)
    with pytest.raises(ValueError, match="router_bias_rate=-1.0 must be >= 0"):
        TrainerConfig(router_bias_rate=-1.0).check()
