"""Rollout routing replay for mixture-of-experts models (models.moe, train.router_replay): the routes a forward records,
replaying them (the same forward when they are its own; gradients only into the replayed experts and the router;
unrolled, scanned and rematerialised alike), the trainer's agreement metric and replayed update, and the errors for
missing routes. The sampler's recording: tests/test_sampler_routes.py."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.moe import MoE
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig
from areal_jax.trainer.batch import Trajectory
from tests.test_trainer import mesh_1, mesh_4, tree_rel_err

CFG = tiny_config("qwen3_moe", num_layers=3, moe_layers=(1, 0, 1))  # two expert layers around a dense one
TOKENS = jnp.asarray(np.random.default_rng(0).integers(3, CFG.vocab_size, (2, 11)), jnp.int32)
SEGMENTS = jnp.asarray([[1] * 11, [1] * 7 + [0] * 4], jnp.int32)


def own_routes(model, tokens, segments=None, **kw):
    """[B, T, L_moe, k] the experts the model's own routers pick (record_routes)."""
    return model.hidden(tokens, segment_ids=segments, record_routes=True, **kw)[1]["routes"]


@pytest.mark.long  # 24 s in CI; the sampler's recorded routes against a full forward: tests/test_sampler_routes.py
def test_recorded_routes_are_each_layers_top_k():
    """The routes of the first expert layer are the top k of its router over its input (the embeddings after the
    first attention block), computed here through the layer's own pieces; replaying a model's own routes changes
    nothing, and its routers then agree with every pick."""
    model = random_model(CFG, seed=1)
    routes = own_routes(model, TOKENS)
    assert routes.shape == (2, 11, 2, CFG.num_experts_per_tok) and routes.dtype == jnp.int32
    layer = model.layers[0]
    x = model.embed(TOKENS)
    from areal_jax.models.rope import rope_tables

    cos, sin = rope_tables(CFG, jnp.broadcast_to(jnp.arange(11)[None], (2, 11)))[CFG.layer_rope(0)]
    q, k, v = layer.attn.qkv(layer.input_norm(x), cos, sin)
    from areal_jax.models.layers import dot_attention

    causal = jnp.broadcast_to(jnp.tril(jnp.ones((11, 11), bool))[None], (2, 11, 11))
    x = x + layer.attn.out(dot_attention(q, k, v, causal))
    _, want = layer.mlp.routing(layer.post_attn_norm(x))
    np.testing.assert_array_equal(np.sort(np.asarray(routes[:, :, 0]), -1), np.sort(np.asarray(want), -1))

    plain = model.hidden(TOKENS, segment_ids=SEGMENTS)
    replayed, extras = model.hidden(TOKENS, segment_ids=SEGMENTS, routes=own_routes(model, TOKENS, SEGMENTS),
                                    replay=True, router_stats=True)
    np.testing.assert_allclose(np.asarray(replayed), np.asarray(plain), atol=1e-6)
    real = int(jnp.sum(SEGMENTS > 0))
    np.testing.assert_array_equal(np.asarray(extras["agree"]), [real * CFG.num_experts_per_tok] * 2)


def test_replay_sends_tokens_to_the_given_experts_only():
    """Every token replayed to experts 0 and 1: experts 2 and 3 get no gradient, the router does (through the
    replayed experts' probabilities), the output differs from the model's own routing, and the agreement counts
    exactly the own picks among {0, 1}."""
    model = random_model(CFG, seed=2)
    forced = jnp.broadcast_to(jnp.asarray([0, 1], jnp.int32), (2, 11, 2, 2))
    graphdef, params = nnx.split(model)

    def loss(p):
        h = nnx.merge(graphdef, p).hidden(TOKENS, routes=forced, replay=True)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    grads = jax.grad(loss)(params)
    for i in (0, 2):
        mlp = grads["layers"][i]["mlp"]
        for name in ("experts_gate", "experts_up", "experts_down"):
            g = np.asarray(mlp[name][...])
            assert np.abs(g[:2]).max() > 0 and np.abs(g[2:]).max() == 0, (i, name)
        assert float(jnp.abs(mlp["router"][...]).max()) > 0
    assert float(jnp.abs(model.hidden(TOKENS, routes=forced, replay=True) - model.hidden(TOKENS)).max()) > 1e-3
    own = np.asarray(own_routes(model, TOKENS))
    _, extras = model.hidden(TOKENS, routes=forced, router_stats=True)  # compared, not replayed
    np.testing.assert_array_equal(np.asarray(extras["agree"]), (own < 2).sum(axis=(0, 1, 3)))


@pytest.mark.parametrize("kw", [{"scan_layers": True}, {"remat": "full"}, {"scan_layers": True, "remat": "dots"}])
def test_replay_unrolled_scanned_and_rematerialised_agree(kw):
    cfg = tiny_config("qwen3_moe", num_layers=4)  # one structure: the scan runs
    model = random_model(cfg, seed=3)
    forced = jnp.asarray(np.random.default_rng(1).permuted(np.tile(np.arange(4), (2, 11, 4, 1)), axis=-1)[..., :2],
                         jnp.int32)
    want, want_extras = model.hidden(TOKENS, segment_ids=SEGMENTS, routes=forced, replay=True, router_stats=True,
                                     record_routes=True)
    got, extras = model.hidden(TOKENS, segment_ids=SEGMENTS, routes=forced, replay=True, router_stats=True,
                               record_routes=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(extras["routes"]), np.asarray(forced))  # the experts they went to
    np.testing.assert_array_equal(np.asarray(extras["agree"]), np.asarray(want_extras["agree"]))


def test_routes_of_the_wrong_shape_are_refused():
    model = random_model(CFG, seed=1)
    with pytest.raises(ValueError, match=r"routes must be \[batch, time, mixture-of-experts layers, experts per "
                                         r"token\] = \(2, 11, 2, 2\)"):
        model.hidden(TOKENS, routes=jnp.zeros((2, 11, 3, 2), jnp.int32), replay=True)
    with pytest.raises(ValueError, match="replay needs routes"):
        MoE(CFG, rngs=nnx.Rngs(0))(jnp.ones((3, CFG.hidden_size)), replay=True)


def with_routes(trajs, routes_of):
    return [dataclasses.replace(t, routes=routes_of(t)) for t in trajs]


@pytest.mark.long  # (excluded from the default run: `-m long`)
def test_trainer_measures_agreement_and_replays():
    """measure: the trainer's own routes agree fully, random ones about as often as chance; replay of its own routes
    gives the loss and gradients of no replay, of others a different loss; missing routes are a clear error."""
    trajs = random_trajectories(6, vocab=CFG.vocab_size, seed=1, min_len=8, max_len=20)
    start = random_model(CFG, seed=5)
    own = with_routes(trajs, lambda t: np.asarray(own_routes(start, jnp.asarray(t.tokens[None]))[0]))
    rng = np.random.default_rng(2)
    rand = with_routes(trajs, lambda t: np.stack([rng.permutation(4)[:2] for _ in range(len(t.tokens) * 2)])
                       .reshape(len(t.tokens), 2, 2))

    def trainer(mode, mesh=None):
        tc = TrainerConfig(micro_batch_tokens=256, logits_chunk=16, lr=1e-3, router_replay=mode)
        return Trainer(random_model(CFG, seed=5), tc, mesh or mesh_1())

    assert trainer("measure").update(own)["moe_route_agreement"] == pytest.approx(1.0)
    chance = trainer("measure").update(rand)["moe_route_agreement"]
    assert 0.2 < chance < 0.8  # two of four experts: half of the picks by chance
    assert "moe_route_agreement" not in trainer("off").update(own)
    base_loss, base = trainer("off").loss_and_grads(own)
    loss, grads = trainer("replay").loss_and_grads(own)
    assert loss == pytest.approx(base_loss, rel=1e-5) and tree_rel_err(grads, base) < 1e-5
    other_loss, other = trainer("replay").loss_and_grads(rand)
    assert tree_rel_err(other, base) > 1e-2
    sharded_loss, sharded = trainer("replay", mesh_4()).loss_and_grads(rand)  # rows per device, the routes too
    assert sharded_loss == pytest.approx(other_loss, rel=1e-5)
    assert tree_rel_err(jax.device_get(sharded), jax.device_get(other)) < 1e-5
    with pytest.raises(ValueError, match=r"train.router_replay=replay needs each trajectory's routes \[tokens, 2, 2\]"):
        trainer("replay").update(trajs)
    bad = with_routes(own[:1], lambda t: t.routes + 4)
    with pytest.raises(ValueError, match=r"trajectory 0's routes name experts outside 0..3 \(4..7\)"):
        trainer("replay").update(bad)
    with pytest.raises(ValueError, match="Trajectory.routes has shape"):
        Trajectory(tokens=[1, 2, 3], prompt_len=1, behav_logp=[0.0, 0.0], versions=[0, 0], routes=np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match=r"Trajectory.routes must hold expert ids \(integers\), got dtype float64"):
        Trajectory(tokens=[1, 2, 3], prompt_len=1, behav_logp=[0.0, 0.0], versions=[0, 0], routes=np.zeros((3, 2, 2)))
