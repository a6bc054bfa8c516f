"""train.scan_layers: the decoder layers of the update as one lax.scan give the unrolled loop's results.

Reference: the same model run with its layers unrolled (the default), values and gradients, and whole
Trainer updates compared metric by metric and parameter by parameter.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models.lora import LoRAConfig, apply_lora
from areal_jax.models.packed_attention import scannable
from areal_jax.testing import models as testing
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig

CFG = testing.tiny_config(num_layers=3, max_position_embeddings=512)


def packed_rows(t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    seg = np.zeros((2, t), np.int32)
    pos = np.zeros((2, t), np.int32)
    for r in range(2):
        at, sid = 0, 1
        while at < t - 8:
            n = int(min(rng.integers(8, t // 2), t - at))
            seg[r, at:at + n], pos[r, at:at + n] = sid, np.arange(n)
            at, sid = at + n, sid + 1
    tokens = rng.integers(0, CFG.vocab_size, (2, t)).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)


@pytest.mark.parametrize("attention,remat", [("dense", "none"), ("blocked", "full"), ("dense", "dots")])
def test_scanned_layers_give_the_unrolled_values_and_gradients(attention, remat):
    model = testing.random_model(CFG, seed=1)
    graphdef, params = nnx.split(model)
    tokens, pos, seg = packed_rows(384)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(2, 384, CFG.hidden_size)), jnp.float32)

    def loss(p, scan):
        h = nnx.merge(graphdef, p).hidden(tokens, pos, seg, attention=attention, remat=remat, scan_layers=scan)
        return jnp.sum(h * w)

    assert scannable(model.layers) is not None
    (v0, g0), (v1, g1) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, s) for s in (False, True))
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):  # float32 sums in another order (AVX-512 too)
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=5e-5)


@pytest.mark.parametrize("arch,layers,period", [("gemma3", 13, 6), ("olmo3", 9, 4)])
def test_a_repeating_pattern_of_windows_scans_in_groups(arch, layers, period):
    """Gemma 3 (5 sliding layers then a global one, each kind with its RoPE table) and OLMo 3 (3 + 1): one scan
    over whole groups of the pattern, the remainder unrolled; values and gradients as the unrolled loop's."""
    types = tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers))
    cfg = testing.tiny_config(arch, num_layers=layers, layer_types=types, sliding_window=40, hidden_size=32,
                              intermediate_size=48, num_heads=2, num_kv_heads=1, max_position_embeddings=512)
    model = testing.random_model(cfg, seed=3)
    graphdef, params = nnx.split(model)
    tokens, pos, seg = packed_rows(128)
    tokens = tokens % cfg.vocab_size
    w = jnp.asarray(np.random.default_rng(4).normal(size=(2, 128, cfg.hidden_size)), jnp.float32)

    def loss(p, scan):
        h = nnx.merge(graphdef, p).hidden(tokens, pos, seg, attention="dense", remat="full", scan_layers=scan)
        return jnp.sum(h * w)

    jaxpr = str(jax.make_jaxpr(lambda p: loss(p, True))(params))
    assert jaxpr.count("scan[") == 1 and f"length={layers // period}" in jaxpr
    (v0, g0), (v1, g1) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, s) for s in (False, True))
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):  # 13 float32 layers summed in another order
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-4 * float(jnp.abs(a).max()))


@pytest.mark.parametrize("impl", ["blocked", "ragged"])
def test_expert_layers_scan_too(impl):
    """A mixture-of-experts model (every layer with experts) scans like a dense one, on either expert path, with
    the router's top-k and the ragged path's sort inside the scanned, rematerialised body; one dense layer among
    them makes the layers differ in structure, and the loop stays unrolled."""
    cfg = testing.tiny_config("qwen3_moe", num_layers=3, moe_impl=impl, max_position_embeddings=512)
    model = testing.random_model(cfg, seed=5)
    graphdef, params = nnx.split(model)
    tokens, pos, seg = packed_rows(96)
    w = jnp.asarray(np.random.default_rng(6).normal(size=(2, 96, cfg.hidden_size)), jnp.float32)

    def loss(p, scan):
        h = nnx.merge(graphdef, p).hidden(tokens, pos, seg, attention="dense", remat="full", scan_layers=scan)
        return jnp.sum(h * w)

    assert scannable(model.layers) is not None
    assert scannable(testing.random_model(cfg.replace(moe_layers=(1, 0, 1))).layers) is None
    (v0, g0), (v1, g1) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, s) for s in (False, True))
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=5e-5)


def test_layers_of_different_structure_or_with_rng_state_are_unrolled():
    assert scannable(testing.random_model(dataclasses.replace(CFG, num_layers=1)).layers) is None  # one layer
    some = apply_lora(testing.random_model(CFG), LoRAConfig(rank=2, targets="re:layers\\.0\\.attn\\.q_proj"),
                      rngs=nnx.Rngs(0))
    assert scannable(some.layers) is None  # only layer 0 has an adapter
    # Every adapter has its own dropout salt (a static attribute), so adapted layers differ in structure:
    # a LoRA model's update stays unrolled, with the same results (test below).
    every = apply_lora(testing.random_model(CFG), LoRAConfig(rank=2), rngs=nnx.Rngs(0))
    assert scannable(every.layers) is None


@pytest.mark.parametrize("lora", [False, True])
def test_a_scanned_update_equals_the_unrolled_one(lora):
    trajs = random_trajectories(8, vocab=CFG.vocab_size, seed=5, max_len=48)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    results = []
    for scan in (False, True):
        model = testing.random_model(CFG, seed=0)
        if lora:
            apply_lora(model, LoRAConfig(rank=4, targets="attn"), rngs=nnx.Rngs(0))
            model = testing.randomize_params(model, seed=3)  # B != 0, so the adapters change the forward
        cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=128, logits_chunk=64, ppo_minibatches=2, remat="full",
                            scan_layers=scan)
        trainer = Trainer(model, cfg, mesh, wrt=nnx.LoRAParam if lora else nnx.Param)
        metrics = [trainer.update(trajs) for _ in range(2)]
        results.append((metrics, jax.device_get(trainer.state.params)))
    (m0, p0), (m1, p1) = results
    for a, b in zip(m0, m1):
        for key in ("loss", "grad_norm", "entropy", "clip_fraction", "n_tokens"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)
    # 4 AdamW steps of lr 1e-3: within 5% of one step (Adam's normalised step magnifies the float32 rounding of
    # near-zero gradients, which the two programs sum in different orders)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=5e-5)


def test_expert_parallel_layers_scan_on_a_2x2_mesh():
    """Scanned mixture-of-experts layers on fsdp x tensor = 2 x 2 (each device two of the four experts, half their
    width) give one device's loss and gradients."""
    from tests.test_trainer import mesh_1, mesh_4, tree_rel_err

    cfg = testing.tiny_config("qwen3_moe", num_layers=3, max_position_embeddings=512)
    assert cfg.expert_parallel
    trajs = random_trajectories(10, vocab=cfg.vocab_size, min_len=5, max_len=40, seed=3)
    tc = TrainerConfig(micro_batch_tokens=64, logits_chunk=16, remat="full", scan_layers=True)
    want_loss, want = Trainer(testing.random_model(cfg, seed=2), tc, mesh_1()).loss_and_grads(trajs)
    got_loss, got = Trainer(testing.random_model(cfg, seed=2), tc, mesh_4()).loss_and_grads(trajs)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert tree_rel_err(jax.device_get(got), jax.device_get(want)) < 1e-5
