"""Attention sinks (gpt-oss): every attention path against HF's eager form (the sink as a last score column, dropped
after the softmax), in values and in gradients with respect to q, k, v and the sinks; the o_proj bias; a model's
KV-cache and paged decode against its full forward."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from areal_jax.models import init_cache
from areal_jax.models.blocked_attention import blocked_attention
from areal_jax.models.cache_attention import cached_attention, ring_attention
from areal_jax.models.flash_attention import flash_attention
from areal_jax.models.layers import dot_attention
from areal_jax.models.packed_attention import packed_attention, packed_mask
from areal_jax.models.paged_attention import (
    PagedKVCache,
    gather_attention,
    init_paged_cache,
    kernel_attention,
    paged_hidden,
)
from areal_jax.models.splash import splash_attention
from areal_jax.testing.models import random_model, tiny_config

B, T, H, KV, DH = 2, 32, 4, 2, 16


def reference(q, k, v, mask, sinks):
    """HF's eager_attention_forward: q [B, T, H, Dh], k, v [B, S, K, Dh], mask [B, T, S] bool, sinks [H] or None;
    keys repeated per query head, the sink a last logit column of value zero."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:3], 1))
        scores = jnp.concatenate([scores, sink], axis=-1)
    top = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - top)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        probs = probs[..., :-1]
    return jnp.einsum("bhts,bshd->bthd", probs, v)


def packed_segments():
    """[B, T]: row 0 three sequences and four padding positions (id 0), row 1 two sequences."""
    seg = np.zeros((B, T), np.int32)
    seg[0, :9], seg[0, 9:20], seg[0, 20:28] = 1, 2, 3
    seg[1, :21], seg[1, 21:] = 1, 2
    return jnp.asarray(seg)


def inputs(seed=0, t=T, s=None):
    rng = np.random.default_rng(seed)
    s = t if s is None else s
    q = jnp.asarray(rng.normal(size=(B, t, H, DH)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, s, KV, DH)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=(H,)) + np.array([-1.0, 0.0, 1.0, 2.0]), jnp.float32)
    return q, k, v, sinks


def assert_close(got, want, atol=2e-5, what=""):
    scale = max(1.0, float(jnp.max(jnp.abs(want))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=atol * scale, err_msg=what)


def check_values_and_grads(attend, mask, seed=0, atol=2e-5):
    """attend(q, k, v, sinks) against `reference`, and the gradients of a random projection of it."""
    q, k, v, sinks = inputs(seed)
    w = jnp.asarray(np.random.default_rng(seed + 1).normal(size=q.shape), jnp.float32)
    want = reference(q, k, v, mask, sinks)
    assert_close(jax.jit(attend)(q, k, v, sinks), want, atol, "values")

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * w)

    got = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    ref = jax.grad(loss(lambda q, k, v, s: reference(q, k, v, mask, s)), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, a, b in zip(("q", "k", "v", "sinks"), got, ref):
        assert_close(a, b, atol, f"d{name}")


TRAINING = {
    "dense": lambda seg, window: lambda q, k, v, s: dot_attention(q, k, v, packed_mask(seg, window), sinks=s),
    "blocked": lambda seg, window: lambda q, k, v, s: blocked_attention(q, k, v, seg, 8, window=window, sinks=s),
    "flash": lambda seg, window: lambda q, k, v, s: flash_attention(q, k, v, seg, block_q=16, block_k=16,
                                                                    interpret=True, window=window, sinks=s),
    "splash": lambda seg, window: lambda q, k, v, s: splash_attention(q, k, v, seg, interpret=True, window=window,
                                                                      sinks=s),
}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("path", sorted(TRAINING))
def test_training_paths_equal_the_eager_form(path, window):
    seg = packed_segments()
    check_values_and_grads(TRAINING[path](seg, window), packed_mask(seg, window))


@pytest.mark.parametrize("choice", ["dense", "blocked", "flash"])
def test_packed_attention_passes_the_sinks(choice):
    seg = packed_segments()
    attend = packed_attention(seg, choice, "cpu")
    if choice == "blocked":  # rows too short for the model's own block size: call the function itself
        attend = TRAINING["blocked"](seg, None)
    check_values_and_grads(attend, packed_mask(seg))


def test_flash_splits_the_sinks_with_the_heads_on_a_mesh():
    """Under a mesh context the kernel runs per shard of rows and heads: each device gets its heads' sinks."""
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    seg = packed_segments()
    with jax.set_mesh(mesh):
        attend = packed_attention(seg, "flash", "cpu")
        jaxpr = jax.make_jaxpr(attend)(*inputs())
        assert jaxpr.jaxpr.eqns[0].params["in_specs"][-1] == jax.sharding.PartitionSpec("tensor")
        check_values_and_grads(attend, packed_mask(seg))


@pytest.mark.parametrize("path", sorted(TRAINING))
def test_very_negative_sinks_give_plain_attention(path):
    seg = packed_segments()
    q, k, v, _ = inputs(3)
    fn = TRAINING[path](seg, None)
    plain = fn(q, k, v, None)
    np.testing.assert_allclose(np.asarray(fn(q, k, v, jnp.full((H,), -1e9))), np.asarray(plain), rtol=1e-6,
                               atol=1e-6)
    assert_close(plain, reference(q, k, v, packed_mask(seg), None))


def decode_mask(positions, s, window=None):
    """[B, T, S]: cache index j is visible to a query at position p iff j <= p (and p - j < window)."""
    j = jnp.arange(s)[None, None, :]
    p = positions[:, :, None]
    visible = j <= p
    return visible if window is None else visible & (j > p - window)


@pytest.mark.parametrize("window", [None, 5])
def test_cache_attention_equals_the_eager_form(window):
    s = 40
    q, k, v, sinks = inputs(4, t=6, s=s)
    # prefill-like queries at scattered positions; -1: no visible key (only the sink: zeros)
    positions = jnp.asarray([[0, 3, 9, 17, 31, 39], [-1, 1, 8, 15, 16, 24]], jnp.int32)
    want = reference(q, k, v, decode_mask(positions, s, window), sinks)
    want = jnp.where((positions >= 0)[:, :, None, None], want, 0.0)
    for kwargs in ({"chunk_size": 8}, {"chunk_size": 8, "counted": True}, {"chunk_size": 64},
                   {"chunk_size": 8, "score_elements": 2 * 2 * H * 8}):  # the last in query blocks of two
        got = cached_attention(q, k, v, positions, window=window, sinks=sinks, **kwargs)
        assert not np.isnan(np.asarray(got)).any()
        assert_close(got, want, what=str(kwargs))
    one = positions[:, 4:5]  # a decode step (with a window: `window_decode_attention`)
    assert_close(cached_attention(q[:, 4:5], k, v, one, chunk_size=8, window=window, sinks=sinks), want[:, 4:5])
    np.testing.assert_allclose(np.asarray(cached_attention(q, k, v, jnp.maximum(positions, 0), chunk_size=8,
                                                           sinks=jnp.full((H,), -1e9))),
                               np.asarray(cached_attention(q, k, v, jnp.maximum(positions, 0), chunk_size=8)),
                               rtol=1e-6, atol=1e-6)


def test_ring_attention_equals_the_eager_form():
    window, r, s = 6, 8, 40
    q, k, v, sinks = inputs(5, t=1, s=s)
    positions = jnp.asarray([[3], [29]], jnp.int32)
    want = reference(q, k, v, decode_mask(positions, s, window), sinks)
    index = np.arange(s)
    ring_k = jnp.zeros((B, r, KV, DH)).at[:, index % r].set(k)  # later positions overwrite earlier ones
    ring_v = jnp.zeros((B, r, KV, DH)).at[:, index % r].set(v)
    rows = []
    for b, p in enumerate(np.asarray(positions[:, 0])):  # each row's ring as it stands at its own position
        held = np.arange(max(0, p - r + 1), p + 1)
        rows.append((jnp.zeros((r, KV, DH)).at[held % r].set(k[b, held]),
                     jnp.zeros((r, KV, DH)).at[held % r].set(v[b, held])))
    ring_k, ring_v = jnp.stack([x for x, _ in rows]), jnp.stack([y for _, y in rows])
    assert_close(ring_attention(q, ring_k, ring_v, positions, window, sinks=sinks), want)


def test_paged_attention_equals_the_eager_form():
    s, ps = 32, 4
    q, k, v, sinks = inputs(6, t=1, s=s)
    positions = jnp.asarray([[13], [31]], jnp.int32)
    per_row, pages = s // ps, 2 * s // ps + 3
    table = np.random.default_rng(0).permutation(pages)[:B * per_row].reshape(B, per_row).astype(np.int32)
    pk, pv = np.full((KV, pages, ps, DH), 1e3, np.float32), np.full((KV, pages, ps, DH), -1e3, np.float32)
    for b in range(B):
        for j in range(per_row):
            pk[:, table[b, j]] = np.asarray(k[b, j * ps:(j + 1) * ps]).transpose(1, 0, 2)
            pv[:, table[b, j]] = np.asarray(v[b, j * ps:(j + 1) * ps]).transpose(1, 0, 2)
    cache, table = PagedKVCache((jnp.asarray(pk),), (jnp.asarray(pv),)), jnp.asarray(table)
    assert_close(gather_attention(q, cache, 0, table, positions, sinks=sinks),
                 reference(q, k, v, decode_mask(positions, s), sinks))
    assert_close(gather_attention(q, cache, 0, table, positions, window=6, sinks=sinks),
                 reference(q, k, v, decode_mask(positions, s, 6), sinks))
    for platform in ("gpu", "tpu"):  # the kernels take no sinks: the call reads the gathered view
        got = kernel_attention(q, cache, 0, table, positions, interpret=True, platform=platform, sinks=sinks)
        assert_close(got, reference(q, k, v, decode_mask(positions, s), sinks), what=platform)


def sink_model(arch, **overrides):
    """A tiny model with attention sinks and an o_proj bias, both drawn at random (sinks of O(1))."""
    model = random_model(tiny_config(arch, attention_sinks=True, attention_out_bias=True, **overrides), seed=2)
    rng = np.random.default_rng(7)
    for layer in model.layers:
        layer.attn.sinks[...] = jnp.asarray(rng.normal(size=layer.attn.sinks.shape) + 1.0, jnp.float32)
        layer.attn.o_bias[...] = jnp.asarray(0.3 * rng.normal(size=layer.attn.o_bias.shape), jnp.float32)
    return model


def test_parameters_and_their_effect():
    model = sink_model("llama")
    attn = model.layers[0].attn
    assert attn.sinks.shape == (4,) and attn.o_bias.shape == (64,)
    plain = random_model(tiny_config("llama"), seed=2).layers[0].attn
    assert plain.sinks is None and plain.o_bias is None
    np.testing.assert_allclose(np.asarray(attn.out(jnp.zeros((1, 3, 4, 16)))),
                               np.broadcast_to(np.asarray(attn.o_bias[...]), (1, 3, 64)))


@pytest.mark.parametrize("arch,overrides", [("qwen2", {}), ("llama", {"sliding_window": 5})])
def test_cache_and_paged_decode_equal_the_full_forward(arch, overrides):
    model = sink_model(arch, **overrides)
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    total, prompt, ps = 12, 5, 4
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (B, total)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (B, total))
    want = np.asarray(jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, tokens))
    plain = random_model(tiny_config(arch, **overrides), seed=2)
    assert np.abs(want - np.asarray(plain(tokens))).max() > 1e-2  # the sinks and the bias matter

    dense = jax.jit(lambda st, t, p, c: nnx.merge(graphdef, st)(t, p, cache=c))
    logits, cache = dense(state, tokens[:, :prompt], positions[:, :prompt], init_cache(cfg, B, 16))
    got = [logits]
    for p in range(prompt, total):
        logits, cache = dense(state, tokens[:, p:p + 1], positions[:, p:p + 1], cache)
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=1e-4, rtol=0)

    table = jnp.arange(B * 4, dtype=jnp.int32).reshape(B, 4)  # 4 pages of 4 positions per row

    def paged(st, t, p, c, path):
        m = nnx.merge(graphdef, st)
        h, c = paged_hidden(m, t, p, c, table, path=path, interpret=True)
        return m.unembed(h), c

    for path in ("gather", "kernel"):
        step = jax.jit(paged, static_argnums=4)
        logits, pages = step(state, tokens[:, :prompt], positions[:, :prompt], init_paged_cache(cfg, B * 4, ps), path)
        got = [logits]
        for p in range(prompt, total):
            logits, pages = step(state, tokens[:, p:p + 1], positions[:, p:p + 1], pages, path)
            got.append(logits)
        np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=1e-4, rtol=0, err_msg=path)


def test_model_gradients_reach_the_sinks_on_every_training_path():
    model = sink_model("qwen2")
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, 97, (B, T)), jnp.int32)
    seg = packed_segments()

    def loss(st, attention):
        h = nnx.merge(graphdef, st).hidden(tokens, segment_ids=seg, attention=attention)
        return jnp.sum(jnp.sin(h))

    grads = {a: jax.jit(jax.grad(loss), static_argnums=1)(state, a) for a in ("dense", "flash")}
    sinks = [np.asarray(g["layers"][0]["attn"]["sinks"][...]) for g in grads.values()]
    assert np.abs(sinks[0]).min() > 0
    np.testing.assert_allclose(sinks[1], sinks[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_with_sinks_lower_for_their_accelerators(platform):
    """Flash (Triton) and splash (Mosaic) with sinks, forward and backward, through their real lowering (`jax.export`
    on the CPU, as tests/test_accelerator_lowering.py)."""
    from jax import export

    attend = flash_attention if platform == "cuda" else splash_attention
    t, dh = 256, 128

    def loss(q, k, v, seg, sinks):
        return attend(q, k, v, seg, interpret=False, sinks=sinks).astype(jnp.float32).sum()

    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, t, H, dh), (B, t, KV, dh), (B, t, KV, dh))]
    shapes += [jax.ShapeDtypeStruct((B, t), jnp.int32), jax.ShapeDtypeStruct((H,), jnp.float32)]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4))), platforms=[platform],
                         disabled_checks=checks)(*shapes).mlir_module()
    assert text.count("@__gpu$xla.gpu.triton" if platform == "cuda" else "@tpu_custom_call") >= 3
