"""Chunked cache attention against a plain numpy reference (heads repeated explicitly, full softmax)."""
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.cache_attention import cached_attention, query_block_size


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


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 5, 16])
@pytest.mark.parametrize("t,kv", [(1, 2), (4, 1), (3, 4)])
def test_chunked_cache_attention_matches_reference(chunk, t, kv, counted):
    rng = np.random.default_rng(chunk * 10 + t)
    layers, b, s, h, d = 2, 3, 16, 4, 8
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    kc = rng.normal(size=(layers, b, s, kv, d)).astype(np.float32)
    vc = rng.normal(size=(layers, b, s, kv, d)).astype(np.float32)
    positions = np.stack([rng.integers(-2, s + 3, size=t) for _ in range(b)]).astype(np.int32)
    positions[0] = np.arange(t) + 5  # one ordinary row
    got = cached_attention(jnp.asarray(q), jnp.asarray(kc[1]), jnp.asarray(vc[1]), jnp.asarray(positions),
                           chunk_size=chunk, counted=counted)
    want = reference(q, kc, vc, 1, positions)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    assert np.all(np.asarray(got)[positions < 0] == 0)  # a query before the start attends nothing


def packed_reference(q, k, v, seg):
    """float64 loop: query i of a row attends keys j <= i with the same segment id."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for ti in range(t):
            keys = [j for j in range(ti + 1) if seg[bi, j] == seg[bi, ti]]
            for hi in range(h):
                kh = hi // (h // kv)
                scores = k[bi, keys, kh].astype(np.float64) @ q[bi, ti, hi].astype(np.float64) / np.sqrt(d)
                w = np.exp(scores - scores.max())
                out[bi, ti, hi] = (w / w.sum()) @ v[bi, keys, kh].astype(np.float64)
    return out


def _segments(t, lengths):
    out = np.zeros(t, np.int32)  # trailing padding keeps id 0 (it attends earlier padding, like packed_mask)
    p = 0
    for i, n in enumerate(lengths):
        out[p:p + n] = i + 1
        p += n
    return out


def test_blocked_attention_matches_loop_reference_and_dense_gradients():
    import jax

    from areal_jax.models import blocked_attention as ba
    from areal_jax.models.layers import dot_attention
    from areal_jax.models.transformer import packed_mask

    rng = np.random.default_rng(7)
    b, t, h, kv, d, block = 3, 12, 4, 2, 8, 4
    # row 0: short sequences, so the pairs (2, 0), (1, 0) and (2, 1) of 4-token blocks can all be skipped
    # for it; row 1: one long sequence (nothing skipped); row 2: sequences crossing block edges + padding.
    seg = np.stack([_segments(t, [4, 4, 4]), _segments(t, [12]), _segments(t, [3, 6, 1])])
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k = rng.normal(size=(b, t, kv, d)).astype(np.float32)
    v = rng.normal(size=(b, t, kv, d)).astype(np.float32)
    args = [jnp.asarray(x) for x in (q, k, v)]
    got = ba.blocked_attention(*args, jnp.asarray(seg), block)
    np.testing.assert_allclose(np.asarray(got), packed_reference(q, k, v, seg), rtol=1e-5, atol=1e-5)
    only_short = ba.blocked_attention(*(x[:1] for x in args), jnp.asarray(seg[:1]), block)  # every skip taken
    np.testing.assert_allclose(np.asarray(only_short), packed_reference(q[:1], k[:1], v[:1], seg[:1]),
                               rtol=1e-5, atol=1e-5)

    def loss(fn):
        return lambda q_, k_, v_: jnp.sum(jnp.sin(fn(q_, k_, v_)) * jnp.arange(t)[None, :, None, None])

    g_blocked = jax.grad(loss(lambda *a: ba.blocked_attention(*a, jnp.asarray(seg), block)), (0, 1, 2))(*args)
    g_dense = jax.grad(loss(lambda *a: dot_attention(*a, packed_mask(jnp.asarray(seg)))), (0, 1, 2))(*args)
    for x, y in zip(g_blocked, g_dense):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


def test_attention_block_choice():
    from areal_jax.models.blocked_attention import attention_block

    assert attention_block(384, backend="gpu") is None and attention_block(384, backend="tpu") is None
    assert attention_block(256) is None  # two blocks of 128: dense attention
    assert attention_block(384) == 128 and attention_block(1024) == 128
    assert attention_block(4096) == 512  # at most 8 blocks per row
    assert attention_block(3 * 2 ** 11) == 768
    assert attention_block(400) is None  # not a multiple of the block


def test_cpu_cache_chunks_split_the_cache_evenly():
    from areal_jax.models.cache_attention import CPU_CACHE_CHUNK, cache_chunk_size

    for max_len in range(1, 3000):
        c = cache_chunk_size(max_len, backend="cpu")
        assert 1 <= c <= min(max_len, CPU_CACHE_CHUNK)
        assert -(-max_len // c) == -(-max_len // CPU_CACHE_CHUNK)  # no more loop steps than 128-position chunks
    assert cache_chunk_size(176, backend="cpu") == 88 and cache_chunk_size(1024, backend="cpu") == 128
    assert cache_chunk_size(176, backend="gpu") == 176


def test_one_pass_cache_attention_has_no_loop():
    """A chunk covering the whole cache (the accelerator default up to 8192 positions) reads the layer in one
    pass with no loop in the program: on GPUs each trip of a data-dependent loop is a device -> host round
    trip, once per layer per decode step. A smaller chunk keeps the loop."""
    import jax

    q = jnp.zeros((2, 1, 4, 8))
    kc = jnp.zeros((2, 16, 2, 8))
    pos = jnp.array([[3], [9]], jnp.int32)
    lower = lambda chunk: jax.jit(lambda q, k, v, p: cached_attention(q, k, v, p, chunk_size=chunk)).lower(  # noqa: E731
        q, kc, kc, pos).as_text()
    assert "stablehlo.while" not in lower(16)
    assert "stablehlo.while" in lower(8)


def test_counted_decode_loops_have_a_known_trip_count_and_follow_the_backend_or_the_engine():
    """On GPUs a decode call over a cache longer than one chunk reads every chunk in a loop whose trip count XLA
    knows (a data-dependent one waits for the device before every trip there); the values are the early-stopping
    loop's, with rows far from the cache's end and before its start."""
    import re

    import jax

    from areal_jax.models.cache_attention import counted_decode_loop, counted_decode_loops

    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(3, 1, 4, 8)), jnp.float32)
    kc, vc = (jnp.asarray(rng.normal(size=(3, 40, 2, 8)), jnp.float32) for _ in range(2))
    pos = jnp.array([[2], [17], [-1]], jnp.int32)  # the batch's largest position lies in the second of 5 chunks

    def loops(counted):
        fn = jax.jit(lambda q, k, v, p: cached_attention(q, k, v, p, chunk_size=8, counted=counted))
        hlo = fn.lower(q, kc, vc, pos).compile().as_text()
        whiles = re.findall(r"^.* while\(.*$", hlo, flags=re.M)
        return fn(q, kc, vc, pos), [w for w in whiles if "known_trip_count" not in w]

    early, uncounted = loops(False)
    assert len(uncounted) == 1
    every, uncounted = loops(True)
    assert not uncounted
    np.testing.assert_allclose(np.asarray(every), np.asarray(early), atol=1e-6)
    np.testing.assert_allclose(np.asarray(every)[:2], reference(np.asarray(q), np.asarray(kc)[None],
                                                               np.asarray(vc)[None], 0, np.asarray(pos))[:2], atol=2e-5)
    assert np.all(np.asarray(every)[2] == 0)
    assert counted_decode_loop("gpu") and not counted_decode_loop("cpu") and not counted_decode_loop("tpu")
    with counted_decode_loops(True):
        assert counted_decode_loop("cpu")
        with counted_decode_loops(False):
            assert not counted_decode_loop("gpu")
        with counted_decode_loops(None):
            assert counted_decode_loop("gpu") and not counted_decode_loop("cpu")
    assert not counted_decode_loop("cpu")


def test_query_block_size_by_hand():
    # 2 rows x 4 heads x 16 queries x 8 positions = 1,024 scores
    assert query_block_size(2, 16, 4, 8, score_elements=1024) == 16  # fits: one block
    assert query_block_size(2, 16, 4, 8, score_elements=1023) == 8  # 15 fit (960 scores): two blocks of 8
    assert query_block_size(2, 16, 4, 8, score_elements=64 * 5 + 3) == 4  # 5 fit: four blocks of 4 (8 would not)
    assert query_block_size(2, 100, 4, 8, score_elements=64 * 21) == 20  # 21 fit: five blocks of 20 (24 would not)
    assert query_block_size(2, 100, 4, 8, score_elements=64 * 32) == 32  # 32 fit: four blocks of 25, up to 32
    assert query_block_size(2, 100, 4, 8, score_elements=64 * 30) == 25  # 30 fit: four of 25 (32 would not)
    assert query_block_size(2, 100, 4, 8, score_elements=10) == 1  # not even one query fits: one at a time
    # the accelerator case of the docstring: 8 rows of 16,384 tokens over an 8,192-position chunk, 12 heads
    assert query_block_size(8, 16384, 12, 8192) == 169  # 170 fit: 97 blocks of 169 (176 would not)
    assert query_block_size(8, 1152, 14, 1152) == 576  # 1,040 fit: two blocks of 576, not 1,040 + 112


@pytest.mark.parametrize("chunk,budget", [(16, 3 * 4 * 16 * 5), (5, 3 * 4 * 5 * 8), (3, 1)])
def test_blocked_prefill_queries_match_reference(chunk, budget):
    """A prefill whose scores exceed the budget runs in query blocks (with a padded last block, blocks of one
    query, chunked and one-pass caches) and gives what the float64 reference and the unblocked call give."""
    rng = np.random.default_rng(chunk)
    layers, b, s, h, kv, d, t = 1, 3, 16, 4, 2, 8, 13
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    kc = rng.normal(size=(layers, b, s, kv, d)).astype(np.float32)
    vc = rng.normal(size=(layers, b, s, kv, d)).astype(np.float32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    positions[1] += 3  # a row whose prompt continues a cached prefix
    positions[2, 9:] = -1  # tail padding that attends nothing
    args = (jnp.asarray(q), jnp.asarray(kc[0]), jnp.asarray(vc[0]), jnp.asarray(positions))
    assert query_block_size(b, t, h, chunk, budget) < t
    got = np.asarray(cached_attention(*args, chunk_size=chunk, score_elements=budget))
    np.testing.assert_allclose(got, reference(q, kc, vc, 0, positions), atol=2e-5)
    np.testing.assert_allclose(got, np.asarray(cached_attention(*args, chunk_size=chunk)), atol=1e-6)
    assert np.all(got[positions < 0] == 0)
