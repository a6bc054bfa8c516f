"""A mixture of experts' router statistics (models.moe.router_stats), transformers' load-balancing loss
(models.moe.load_balancing_loss) and the trainer's moe_* metrics and train.router_aux_coef."""
from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models import Transformer
from areal_jax.models.moe import load_balancing_loss, router_stats
from areal_jax.testing.models import random_model, tiny_config, write_random_hf_checkpoint
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig


def test_router_stats_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(9, 5)).astype(np.float32) * 2
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1], bool)
    got = np.asarray(router_stats(jnp.asarray(logits), 2, jnp.asarray(mask)))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    picks = np.zeros(5)
    for row in probs[mask]:
        picks[np.argsort(-row)[:2]] += 1
    np.testing.assert_allclose(got[0], picks)
    np.testing.assert_allclose(got[1], probs[mask].sum(0), rtol=1e-6)
    # Uniform load: every expert picked as often, probabilities uniform -> the loss is k.
    stats = jnp.asarray([[[4.0, 4.0, 4.0, 4.0], [2.0, 2.0, 2.0, 2.0]]] * 3)  # 3 layers, 8 tokens, k = 2
    assert float(load_balancing_loss(stats, jnp.asarray(8))) == pytest.approx(2.0)
    assert float(load_balancing_loss(jnp.zeros((2, 2, 4)), jnp.asarray(0))) == 0.0


@pytest.mark.parity
@pytest.mark.parametrize("arch,layers", [("qwen3_moe", None), ("qwen3_moe", (1, 0, 1)), ("mixtral", None)])
def test_load_balancing_loss_matches_transformers(tmp_path, arch, layers):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    extra = {} if layers is None else {"moe_layers": layers}
    cfg = tiny_config(arch, num_layers=3, num_experts=6, num_experts_per_tok=2, **extra)
    ours = write_random_hf_checkpoint(tmp_path, cfg, seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 17)).astype(np.int32)
    mask = np.ones((2, 17), np.int32)
    mask[1, 11:] = 0  # padding at the end of row 1
    with torch.no_grad():
        out = hf(torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
    stats = ours.hidden(jnp.asarray(tokens), segment_ids=jnp.asarray(mask), router_stats=True)[1]["stats"]
    assert stats.shape == (sum(cfg.layer_is_moe(i) for i in range(3)), 2, 6)
    got = float(load_balancing_loss(stats, jnp.sum(jnp.asarray(mask))))
    assert got == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert got > 2.0  # a random router is not balanced: the comparison has teeth


def test_stats_agree_unrolled_scanned_and_rematerialised():
    cfg = tiny_config("qwen3_moe", num_layers=4)
    model = random_model(cfg, seed=2)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    segments = jnp.asarray([[1] * 7 + [2] * 5, [1] * 9 + [0] * 3], jnp.int32)
    plain = model.hidden(tokens, segment_ids=segments)
    ref_h, ref = model.hidden(tokens, segment_ids=segments, router_stats=True)
    ref = ref["stats"]
    np.testing.assert_array_equal(np.asarray(ref_h), np.asarray(plain))  # the forward itself is unchanged
    assert float(ref[:, 0].sum()) == 4 * 21 * cfg.num_experts_per_tok  # every real token's picks, every layer
    for kw in ({"scan_layers": True}, {"remat": "full"}, {"scan_layers": True, "remat": "dots"}):
        h, stats = model.hidden(tokens, segment_ids=segments, router_stats=True, **kw)
        stats = stats["stats"]
        np.testing.assert_allclose(np.asarray(h), np.asarray(plain), atol=1e-5)
        np.testing.assert_allclose(np.asarray(stats), np.asarray(ref), atol=1e-5)
    dense = random_model(tiny_config("qwen3"), seed=2)
    assert dense.hidden(tokens, segment_ids=segments, router_stats=True)[1] is None


def test_the_statistics_come_from_the_experts_own_routing():
    """One router product per layer: the statistics reuse the logits and the top-k picks the experts ran with."""
    from areal_jax.models.moe import MoE

    cfg = tiny_config("qwen3_moe")
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, cfg.hidden_size))
    mask = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    out, extras = layer(x, mask)
    stats = extras["stats"]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(layer(x)))
    logits = jnp.dot(x.reshape(-1, cfg.hidden_size), layer.router[...], preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(stats), np.asarray(router_stats(logits, cfg.num_experts_per_tok,
                                                                          mask.reshape(-1))), atol=1e-6)

    def router_products(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and eqn.invars[1].aval.shape == layer.router.shape:
                n += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += router_products(sub)
        return n

    assert router_products(jax.make_jaxpr(lambda v: layer(v, mask))(x).jaxpr) == 1


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_stats_and_aux_gradient_on_a_2x2_mesh_equal_one_devices(impl):
    """Under a mesh context each device routes its own rows inside the experts' shard_map and returns its rows'
    statistics, summed outside it: the statistics and the gradient of the load-balancing loss equal one device's."""
    from jax.sharding import AxisType

    from areal_jax.models import shard_params

    cfg = tiny_config("qwen3_moe", num_layers=2, moe_impl=impl)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (4, 10)), jnp.int32)
    segments = jnp.asarray([[1] * 10, [1] * 6 + [0] * 4, [1] * 3 + [2] * 7, [0] * 10], jnp.int32)

    def loss(m):
        h, stats = m.hidden(tokens, segment_ids=segments, router_stats=True)
        stats = stats["stats"]
        return load_balancing_loss(stats, jnp.sum(segments > 0)) + 1e-3 * jnp.mean(h.astype(jnp.float32) ** 2), stats

    (want, want_stats), want_grad = nnx.value_and_grad(loss, has_aux=True)(random_model(cfg, seed=5))
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    model = shard_params(random_model(cfg, seed=5), mesh)

    @nnx.jit
    def sharded(m):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return nnx.value_and_grad(loss, has_aux=True)(m)

    (got, got_stats), got_grad = sharded(model)
    assert float(want_stats[:, 0].sum()) == 2 * 26 * cfg.num_experts_per_tok  # every real token's picks, per layer
    np.testing.assert_allclose(np.asarray(got_stats), np.asarray(want_stats), atol=1e-5)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    router_grads = [(g, w) for (path, g), (_, w) in zip(jax.tree_util.tree_leaves_with_path(got_grad),
                                                        jax.tree_util.tree_leaves_with_path(want_grad))
                    if "router" in jax.tree_util.keystr(path)]
    assert len(router_grads) == 2 and all(float(jnp.abs(w).max()) > 1e-4 for _, w in router_grads)
    for g, w in zip(jax.tree_util.tree_leaves(got_grad), jax.tree_util.tree_leaves(want_grad)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4)


def _trainer(model, **kw):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    return Trainer(model, TrainerConfig(micro_batch_tokens=4096, lr=1e-3, **kw), mesh)


@pytest.mark.long  # 33-69 s; the aux loss's gradient and the picking bias's update have their own tests in CI
def test_trainer_reports_the_load_and_the_aux_loss_enters_the_objective():
    cfg = tiny_config("qwen3_moe", moe_layers=(1, 0))
    trajs = random_trajectories(6, vocab=cfg.vocab_size, seed=1)
    model = random_model(cfg, seed=4)
    # The reference: the loss over every input token of the batch (each trajectory but its last token), one micro-step.
    stats = sum(np.asarray(model.hidden(jnp.asarray(t.tokens[None, :-1]), router_stats=True)[1]["stats"]) for t in trajs)
    n = sum(len(t.tokens) - 1 for t in trajs)
    want = float(load_balancing_loss(jnp.asarray(stats), jnp.asarray(n)))
    load = stats[:, 0] / stats[:, 0].mean(axis=1, keepdims=True)

    off = _trainer(random_model(cfg, seed=4)).update(trajs)
    on_model = random_model(cfg, seed=4)
    on = _trainer(on_model, router_aux_coef=0.5).update(trajs)
    assert off["micro_steps"] == 1 and off["moe_aux_loss"] == pytest.approx(want, rel=1e-5)
    assert off["moe_max_load"] == pytest.approx(load.max(), rel=1e-5)
    assert off["moe_min_load"] == pytest.approx(load.min(), rel=1e-5)
    assert on["moe_aux_loss"] == pytest.approx(want, rel=1e-5)  # both measured at the same starting params
    assert on["loss"] - off["loss"] == pytest.approx(0.5 * want, rel=1e-4)
    dense = _trainer(random_model(tiny_config("qwen3"), seed=4)).update(trajs)
    assert not [k for k in dense if k.startswith("moe_")]


@pytest.mark.long  # 22 s in CI; the aux gradient on a 2 x 2 mesh equal to one device's runs in CI
def test_router_aux_gradient_moves_the_router_toward_balance():
    cfg = tiny_config("qwen3_moe", moe_layers=(1, 0))
    model = random_model(cfg, seed=5)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (4, 16)), jnp.int32)
    graphdef, params = nnx.split(model)

    def aux(p):
        stats = nnx.merge(graphdef, p).hidden(tokens, router_stats=True)[1]["stats"]
        return load_balancing_loss(stats, jnp.asarray(tokens.size))

    grads = jax.grad(aux)(params)
    router_grad = grads["layers"][0]["mlp"]["router"][...]
    assert float(jnp.abs(router_grad).max()) > 0  # the probabilities carry the gradient
    # A small step against it lowers the loss (the counts are piecewise constant).
    stepped = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
    assert float(aux(stepped)) < float(aux(params))
    assert isinstance(nnx.merge(graphdef, params), Transformer)
