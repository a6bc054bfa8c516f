"""LoRA on the experts without forming the adapted weights (models.moe.Factored): every expert path against the same
path on the folded weights W + s A @ B (values and gradients), no weight-sized product in the adapters' backward, the
blocked scan's residuals free of per-block weight copies, and the adapters' gradients on a 2 x 2 mesh equal to one
device's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import lora, moe
from areal_jax.runtime.mesh import MeshConfig, build_meshes
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig
from tests.test_lora import one_device_mesh

E, D, F, K = 6, 64, 32, 2


def _setup(rank, tokens=40, seed=0):
    rng = np.random.default_rng(seed)
    f32 = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2] if len(s) > 2 else 1), jnp.float32)  # noqa: E731
    x = f32(tokens, D)
    weights, experts = moe.route(f32(tokens, E), K, True)
    factors = {name: (f32(E, i, o), f32(E, i, rank), f32(E, rank, o))
               for name, (i, o) in (("gate", (D, F)), ("up", (D, F)), ("down", (F, D)))}
    return x, weights, experts, factors, f32(tokens, D)


def _run(impl, x, weights, experts, factors, scale, folded):
    parts = [factors[n] for n in ("gate", "up", "down")]  # (a traced dict comes back with its keys sorted)
    if folded:
        ws = [lora.merge_experts(w, a, b, scale) for w, a, b in parts]
    else:
        ws = [moe.Factored(w, a, b, scale) for w, a, b in parts]
    return moe.PATHS[impl](x, *ws, weights, experts)


@pytest.mark.parametrize("impl,rank", [("dense", 4), ("ragged", 4), ("blocked", 4), ("blocked", 16),
                                       ("pallas", 16), ("pallas", 4)])  # pallas at rank 4: the scan's fallback
def test_factored_experts_equal_the_folded_weights(impl, rank):
    x, weights, experts, factors, probe = _setup(rank)
    scale = 0.7

    def loss(x, factors, folded):
        return jnp.sum(_run(impl, x, weights, experts, factors, scale, folded) * probe)

    want_out = _run("dense", x, weights, experts, factors, scale, True)
    got_out = _run(impl, x, weights, experts, factors, scale, False)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), atol=2e-5, rtol=1e-4)
    got = jax.grad(loss, argnums=(0, 1))(x, factors, False)
    want = jax.grad(loss, argnums=(0, 1))(x, factors, True)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.abs(w).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5 * float(jnp.abs(w).max()), rtol=1e-4)


def _products(jaxpr):
    """Output shapes of every dot_general in a jaxpr and its sub-jaxprs (scan bodies, checkpoints)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield tuple(eqn.outvars[0].aval.shape)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    yield from _products(sub)


@pytest.mark.parametrize("impl", ["dense", "ragged", "blocked"])
def test_the_adapters_backward_forms_no_weight_sized_product(impl):
    """The adapters' gradient through the factors: no [in, out] product per expert or block (the folded weights'
    gradient, as large as full fine-tuning's) anywhere in the program, which the folded form has."""
    x, weights, experts, factors, probe = _setup(4)

    def loss(ab, folded):
        fs = {n: (factors[n][0], *ab[n]) for n in factors}
        return jnp.sum(_run(impl, x, weights, experts, fs, 0.5, folded) * probe)

    ab = {n: f[1:] for n, f in factors.items()}
    weight_shaped = lambda s: s[-2:] in ((D, F), (F, D))  # noqa: E731
    program = jax.make_jaxpr(jax.grad(loss), static_argnums=1)
    assert any(weight_shaped(s) for s in _products(program(ab, True).jaxpr))
    assert not any(weight_shaped(s) for s in _products(program(ab, False).jaxpr))


@pytest.mark.parametrize("factored", [False, True])
def test_the_blocked_scan_keeps_no_weight_slices_for_its_backward(factored):
    """The scan's residuals (what reverse mode holds from the forward) hold the weights once, not a [blocks, in, out]
    copy of each step's expert slice."""
    x, weights, experts, factors, _ = _setup(4, tokens=400)

    def out(x):
        return _run("blocked", x, weights, experts, factors, 0.5, folded=not factored)

    _, vjp = jax.vjp(out, x)
    shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape")]
    block = moe.expert_block(400 * K, E)
    blocks = -(-(400 * K + E * (block - 1)) // block)
    assert blocks != E and block not in (D, F)  # the residuals tell apart by shape
    assert [s for s in shapes if len(s) == 3 and s[1:] in ((D, F), (F, D))]  # the weights themselves
    assert not [s for s in shapes if len(s) == 3 and s[1:] in ((D, F), (F, D)) and s[0] != E]


def test_sharded_adapter_gradients_equal_one_devices():
    """Trainer gradients of expert and attention adapters under fsdp = 2, tensor = 2 (each device routes its rows and
    runs its slice of each expert's width, the factors split alongside) against one device."""
    cfg = tiny_config("qwen3_moe", num_layers=2, moe_layers=(1, 0))
    model = random_model(cfg, seed=3)
    lcfg = lora.LoRAConfig(rank=4, alpha=8.0, targets="attn,experts")
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(4))
    for i, (_, node) in enumerate(p for p in nnx.iter_graph(model) if isinstance(p[1], lora.LoRAExperts)):
        node.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(10 + i), node.lora_b.shape))
    trajs = random_trajectories(8, vocab=cfg.vocab_size, seed=1, min_len=8, max_len=20)
    tc = TrainerConfig(micro_batch_tokens=128, logits_chunk=16, loss="ppo")
    state = nnx.state(model)
    one = Trainer(nnx.merge(nnx.graphdef(model), state), tc, one_device_mesh(), wrt=nnx.LoRAParam)
    mesh = build_meshes(MeshConfig(colocated=True, fsdp=2, tensor=2)).train_mesh
    four = Trainer(nnx.merge(nnx.graphdef(model), state), tc, mesh, wrt=nnx.LoRAParam)
    loss_1, g_1 = one.loss_and_grads(trajs)
    loss_4, g_4 = four.loss_and_grads(trajs)
    assert abs(loss_1 - loss_4) < 1e-5
    gate = g_4["layers"][0]["mlp"]["experts_gate"]
    assert float(jnp.abs(gate["lora_a"][...]).max()) > 0
    for a, b in zip(jax.tree.leaves(g_1), jax.tree.leaves(g_4)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6 + 1e-4 * float(jnp.abs(a).max()),
                                   rtol=1e-4)
