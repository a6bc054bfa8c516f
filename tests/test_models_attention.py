"""Chunked cache attention against a plain numpy reference (heads repeated explicitly, full softmax)."""
import numpy as np
import pytest
import jax.numpy as jnp

from areal_jax.models.layers import cached_attention


def reference(q, k_cache, v_cache, layer, positions):
    """q [B,T,H,D]; caches [L,B,S,K,D]; query (b,t) attends cache 0..positions[b,t] (none if < 0)."""
    b, t, h, d = q.shape
    k, v = k_cache[layer].astype(np.float64), v_cache[layer].astype(np.float64)
    s, kv = k.shape[1], k.shape[2]
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for ti in range(t):
            p = positions[bi, ti]
            if p < 0:
                continue
            n = min(p, s - 1) + 1
            for hi in range(h):
                kh = hi // (h // kv)
                scores = k[bi, :n, kh] @ q[bi, ti, hi].astype(np.float64) / np.sqrt(d)
                w = np.exp(scores - scores.max())
                out[bi, ti, hi] = (w / w.sum()) @ v[bi, :n, kh]
    return out


@pytest.mark.parametrize("chunk", [1, 3, 5, 16])
@pytest.mark.parametrize("t,kv", [(1, 2), (4, 1), (3, 4)])
def test_chunked_cache_attention_matches_reference(chunk, t, kv):
    rng = np.random.default_rng(chunk * 10 + t)
    layers, b, s, h, d = 2, 3, 16, 4, 8
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    kc = rng.normal(size=(layers, b, s, kv, d)).astype(np.float32)
    vc = rng.normal(size=(layers, b, s, kv, d)).astype(np.float32)
    positions = np.stack([rng.integers(-2, s + 3, size=t) for _ in range(b)]).astype(np.int32)
    positions[0] = np.arange(t) + 5  # one ordinary row
    got = cached_attention(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), 1, jnp.asarray(positions),
                           chunk_size=chunk)
    want = reference(q, kc, vc, 1, positions)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    assert np.all(np.asarray(got)[positions < 0] == 0)  # a query before the start attends nothing
