"""Pallas attention kernels for packed rows (interpret mode on the CPU) against dense attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.flash_attention import flash_attention, segment_bounds
from areal_jax.models.layers import dot_attention
from areal_jax.models.packed_attention import packed_mask, resolve_attention
from areal_jax.models.splash import splash_attention
from areal_jax.testing import models as testing


def packed_segments(rng, b, t, lo, hi, pad):
    """[b, t] int32: runs of lo..hi tokens with ids 1, 2, ...; the last `pad` positions are padding (0)."""
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        pos, sid = 0, 1
        while pos < t - pad:
            n = min(int(rng.integers(lo, hi + 1)), t - pad - pos)
            seg[r, pos:pos + n] = sid
            pos, sid = pos + n, sid + 1
    return seg


def qkv(rng, b, t, h, kv, d, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.normal(size=(b, t, n, d)), dtype) for n in (h, kv, kv))


def dense(q, k, v, seg):
    return dot_attention(q, k, v, packed_mask(jnp.asarray(seg)))


def check_values_and_grads(attn, q, k, v, seg, rtol=2e-5):
    """attn(q, k, v, seg) equals dense attention, and so do the gradients of a random projection of it."""
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    seg = jnp.asarray(seg)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * w)

    out, ref = jax.jit(attn)(q, k, v, seg), dense(q, k, v, seg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=rtol, atol=rtol)
    got = jax.jit(jax.grad(loss(attn), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol * scale, err_msg=f"d{name}")


def test_segment_bounds_match_a_loop():
    seg = np.array([[1, 1, 2, 2, 2, 1, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5, 5]], np.int32)
    first, last = (np.asarray(x) for x in segment_bounds(jnp.asarray(seg)))
    for r in range(2):
        for t in range(9):
            same = np.flatnonzero(seg[r] == seg[r, t])
            assert (first[r, t], last[r, t]) == (same.min(), same.max())


def test_flash_equals_dense_with_many_segments_padding_and_gqa():
    # 120 tokens (not a multiple of the blocks: padded inside), runs of 3-20 tokens, 12 padding tokens,
    # 4 query heads on 2 key/value heads, query and key blocks of different sizes.
    rng = np.random.default_rng(0)
    seg = packed_segments(rng, 2, 120, 3, 20, 12)
    assert len(np.unique(seg[0])) > 8
    q, k, v = qkv(rng, 2, 120, 4, 2, 16)
    check_values_and_grads(lambda q, k, v, s: flash_attention(q, k, v, s, block_q=32, block_k=16), q, k, v, seg)


def test_flash_equals_dense_on_a_long_row_and_repeated_ids():
    # 1024 tokens in 64-token blocks: sequences of 60-300 tokens skip most key blocks; the second row
    # reuses ids out of order (1, 2, 1, ...), which the block bounds must still cover.
    rng = np.random.default_rng(1)
    seg = packed_segments(rng, 2, 1024, 60, 300, 50)
    seg[1] = np.where(seg[1] % 2 == 1, 1, seg[1])  # every odd segment becomes id 1: one id, several runs
    q, k, v = qkv(rng, 2, 1024, 2, 1, 16)
    check_values_and_grads(lambda q, k, v, s: flash_attention(q, k, v, s, block_q=64, block_k=64), q, k, v, seg)


def test_flash_in_bfloat16_stays_close_to_float32_dense():
    rng = np.random.default_rng(2)
    seg = packed_segments(rng, 1, 96, 5, 40, 8)
    q, k, v = qkv(rng, 1, 96, 4, 2, 32, jnp.bfloat16)
    out = flash_attention(q, k, v, jnp.asarray(seg), block_q=32, block_k=32)
    assert out.dtype == jnp.bfloat16
    ref = dense(*(x.astype(jnp.float32) for x in (q, k, v)), seg)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2)


def test_splash_equals_dense_with_segments_padding_and_gqa():
    rng = np.random.default_rng(3)
    seg = packed_segments(rng, 1, 200, 10, 80, 30)  # padded to 256 inside
    q, k, v = qkv(rng, 1, 200, 4, 2, 32)
    check_values_and_grads(lambda q, k, v, s: splash_attention(q, k, v, s, interpret=True), q, k, v, seg, rtol=1e-4)


def test_model_with_flash_attention_and_remat_equals_dense():
    remat = "full"  # the kernel's custom gradient inside jax.checkpoint
    cfg = testing.tiny_config("qwen3", num_layers=2)
    model = testing.random_model(cfg, seed=3)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(4)
    seg = jnp.asarray(packed_segments(rng, 2, 48, 4, 20, 5))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 48)), jnp.int32)
    w = jnp.asarray(rng.normal(size=(2, 48, cfg.hidden_size)), jnp.float32)

    def loss(p, attention):
        m = nnx.merge(graphdef, p)
        return jnp.sum(m.hidden(tokens, segment_ids=seg, attention=attention, remat=remat) * w)

    (got, g_got), (want, g_want) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, a)
                                    for a in ("flash", "dense"))
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))


def test_backend_switch():
    assert resolve_attention("auto", 384, "cpu") == "blocked"
    assert resolve_attention("auto", 64, "cpu") == "dense"  # too short to block
    assert resolve_attention("auto", 384, "gpu") == "flash"
    assert resolve_attention("auto", 384, "tpu") == "splash"
    assert resolve_attention("flash", 384, "tpu") == "splash"
    assert resolve_attention("blocked", 384, "gpu") == "blocked"
    assert resolve_attention("dense", 384, "cpu") == "dense"
    with pytest.raises(ValueError, match="--config.train.attention"):
        resolve_attention("cudnn", 384, "gpu")
