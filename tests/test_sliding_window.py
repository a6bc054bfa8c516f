"""Sliding-window attention (Mistral, Qwen2 with use_sliding_window, Gemma 3) in every attention path, against a
reference that loops over queries and keys in NumPy; and the config's per-layer windows."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.blocked_attention import block_masks, blocked_attention
from areal_jax.models.cache_attention import cached_attention
from areal_jax.models.config import ModelConfig
from areal_jax.models.flash_attention import flash_attention
from areal_jax.models.layers import dot_attention
from areal_jax.models.packed_attention import packed_attention, packed_mask
from areal_jax.models.paged_attention import PagedKVCache, gather_attention
from areal_jax.models.splash import splash_attention


def reference(q, k, v, seg, window):
    """Query i attends key j iff j <= i, i - j < window and both share a segment id: a plain loop."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, dh = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        for i in range(t):
            keys = [j for j in range(max(0, i - window + 1), i + 1) if seg[r, j] == seg[r, i]]
            for head in range(h):
                s = np.array([q[r, i, head] @ k[r, j, head // group] for j in keys]) / math.sqrt(dh)
                p = np.exp(s - s.max())
                out[r, i, head] = (p / p.sum()) @ v[r, keys, head // group]
    return out


def segments(rng, b, t, lo, hi):
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        pos, sid = 0, 1
        while pos < t:
            n = int(rng.integers(lo, hi + 1))
            seg[r, pos:pos + n] = sid
            pos, sid = pos + n, sid + 1
    return seg


def qkv(rng, b, t, h, kv, d):
    return tuple(jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, kv, kv))


def test_packed_mask_by_hand():
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2]])
    got = np.asarray(packed_mask(seg, window=2))[0].astype(int)
    want = np.array([[1, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0],
                     [0, 1, 1, 0, 0, 0],
                     [0, 0, 1, 1, 0, 0],
                     [0, 0, 0, 0, 1, 0],
                     [0, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("window", [1, 7, 40, 1000])
def test_dense_and_blocked_equal_the_reference(window):
    rng = np.random.default_rng(window)
    seg = segments(rng, 2, 384, 30, 200)
    q, k, v = qkv(rng, 2, 384, 4, 2, 8)
    want = reference(q, k, v, seg, window)
    dense = dot_attention(q, k, v, packed_mask(jnp.asarray(seg), window))
    np.testing.assert_allclose(np.asarray(dense), want, atol=2e-5)
    blocked = blocked_attention(q, k, v, jnp.asarray(seg), 128, window=window)
    np.testing.assert_allclose(np.asarray(blocked), want, atol=2e-5)


def test_blocked_leaves_out_the_block_pairs_beyond_the_window():
    seg = jnp.ones((1, 1024), jnp.int32)
    assert len(block_masks(seg, 128)) == 8 * 9 // 2
    # a window of 100 reaches at most one block back: the diagonal and the pair below it
    assert sorted(block_masks(seg, 128, 100)) == sorted([(i, i) for i in range(8)] + [(i, i - 1) for i in range(1, 8)])
    assert len(block_masks(seg, 128, 129)) == 8 + 7  # (i, i - 2): nearest pair 129 apart, out of a 129 window
    assert len(block_masks(seg, 128, 130)) == 8 + 7 + 6


@pytest.mark.parametrize("window", [5, 64, 100])
def test_flash_kernel_values_and_gradients_equal_dense(window):
    """The Pallas kernel (interpreted) with a window: values, and the gradients of q, k and v, equal dense
    attention under the same mask; its block bounds skip what lies outside the window."""
    rng = np.random.default_rng(window)
    seg = jnp.asarray(segments(rng, 2, 200, 20, 150))
    q, k, v = qkv(rng, 2, 200, 4, 2, 16)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def flash(q, k, v):
        return flash_attention(q, k, v, seg, block_q=32, block_k=16, window=window)

    def dense(q, k, v):
        return dot_attention(q, k, v, packed_mask(seg, window))

    np.testing.assert_allclose(np.asarray(jax.jit(flash)(q, k, v)), reference(q, k, v, np.asarray(seg), window),
                               atol=2e-5)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(flash(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(dense(*a) * w), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * float(jnp.abs(b).max()),
                                   err_msg=f"d{name}")


def test_splash_kernel_local_mask_equals_the_reference():
    rng = np.random.default_rng(3)
    seg = segments(rng, 1, 256, 40, 200)
    q, k, v = qkv(rng, 1, 256, 2, 1, 128)
    got = splash_attention(q, k, v, jnp.asarray(seg), window=50)
    np.testing.assert_allclose(np.asarray(got), reference(q, k, v, seg, 50), atol=2e-5)


def test_packed_attention_backends_agree_with_a_window():
    rng = np.random.default_rng(4)
    seg = jnp.asarray(segments(rng, 2, 384, 50, 300))
    q, k, v = qkv(rng, 2, 384, 2, 1, 16)
    want = reference(q, k, v, np.asarray(seg), 33)
    for choice in ("dense", "blocked", "flash"):
        got = packed_attention(seg, choice, "cpu", window=33)(q, k, v)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, err_msg=choice)


@pytest.mark.parametrize("chunk", [None, 8, 24])
def test_cache_attention_with_a_window_equals_the_reference(chunk):
    """Decode and prefill queries over a cache: a row's query at position p sees p - window + 1 .. p; rows
    at different positions, one row inactive (-1)."""
    rng = np.random.default_rng(5)
    b, s, h, kv, dh, window = 3, 64, 4, 2, 8, 10
    kc, vc = (jnp.asarray(rng.normal(size=(b, s, kv, dh)), jnp.float32) for _ in range(2))
    for positions in (np.array([[40], [9], [-1]]), np.array([[30, 31, 32, 33, 34], [0, 1, 2, 3, 4],
                                                             [50, 51, 52, 53, 54]])):
        t = positions.shape[1]
        q = jnp.asarray(rng.normal(size=(b, t, h, dh)), jnp.float32)
        got = np.asarray(cached_attention(q, kc, vc, jnp.asarray(positions, jnp.int32), chunk_size=chunk,
                                          window=window))
        for r in range(b):
            for i in range(t):
                p = positions[r, i]
                if p < 0:
                    np.testing.assert_array_equal(got[r, i], 0.0)
                    continue
                lo = max(0, p - window + 1)
                keys, values = np.asarray(kc[r, lo:p + 1]), np.asarray(vc[r, lo:p + 1])  # [n, K, Dh]
                query = np.asarray(q[r, i]).reshape(kv, h // kv, dh)
                scores = np.einsum("kgd,nkd->kgn", query, keys) / math.sqrt(dh)
                probs = np.exp(scores - scores.max(-1, keepdims=True))
                want = np.einsum("kgn,nkd->kgd", probs / probs.sum(-1, keepdims=True), values).reshape(h, dh)
                np.testing.assert_allclose(got[r, i], want, atol=2e-5)


def test_windowed_decode_reads_only_the_window_and_equals_the_chunked_path():
    from areal_jax.models.cache_attention import _attend_chunks, window_decode_attention

    rng = np.random.default_rng(11)
    b, s, h, kv, dh, window = 4, 200, 4, 1, 16, 20
    kc, vc = (jnp.asarray(rng.normal(size=(b, s, kv, dh)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(b, 1, h, dh)), jnp.float32)
    pos = jnp.asarray([[150], [3], [-1], [199]], jnp.int32)
    want = _attend_chunks(q, kc, vc, pos, 40, window=window)  # every chunk up to the largest position
    np.testing.assert_allclose(np.asarray(window_decode_attention(q, kc, vc, pos, window)), np.asarray(want),
                               atol=2e-5)
    np.testing.assert_allclose(np.asarray(cached_attention(q, kc, vc, pos, window=window)), np.asarray(want),
                               atol=2e-5)
    program = jax.jit(lambda *a: cached_attention(*a, window=window)).lower(q, kc, vc, pos).as_text()
    assert "while" not in program  # one gather of 24 positions per row, no loop over the 200-position cache


def test_paged_gather_with_a_window_equals_the_dense_cache():
    rng = np.random.default_rng(6)
    b, ps, per_row, kv, dh, h = 2, 4, 6, 2, 8, 4
    dense_k, dense_v = (rng.normal(size=(b, ps * per_row, kv, dh)).astype(np.float32) for _ in range(2))
    table = np.array([[5, 0, 7, 2, 9, 11], [1, 3, 4, 6, 8, 10]], np.int32)
    pages_k, pages_v = np.zeros((kv, 12, ps, dh), np.float32), np.zeros((kv, 12, ps, dh), np.float32)
    for r in range(b):
        for slot, page in enumerate(table[r]):
            pages_k[:, page] = dense_k[r, slot * ps:(slot + 1) * ps].transpose(1, 0, 2)
            pages_v[:, page] = dense_v[r, slot * ps:(slot + 1) * ps].transpose(1, 0, 2)
    cache = PagedKVCache(k=(jnp.asarray(pages_k),), v=(jnp.asarray(pages_v),))
    q = jnp.asarray(rng.normal(size=(b, 2, h, dh)), jnp.float32)
    pos = jnp.asarray([[17, 18], [20, 21]], jnp.int32)
    got = gather_attention(q, cache, 0, jnp.asarray(table), pos, window=6)
    want = cached_attention(q, jnp.asarray(dense_k), jnp.asarray(dense_v), pos, window=6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    # decode: only the pages the window reaches are gathered (3 of 6 here), at any position, inactive rows too
    for p0, p1 in [(17, 21), (0, 3), (23, -1), (5, 9)]:
        pos1 = jnp.asarray([[p0], [p1]], jnp.int32)
        got = gather_attention(q[:, :1], cache, 0, jnp.asarray(table), pos1, window=6)
        want = cached_attention(q[:, :1], jnp.asarray(dense_k), jnp.asarray(dense_v), pos1, chunk_size=24, window=6)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, err_msg=str((p0, p1)))
    unwindowed = cached_attention(q, jnp.asarray(dense_k), jnp.asarray(dense_v), pos)
    assert np.abs(np.asarray(unwindowed) - np.asarray(want)).max() > 1e-2  # the window has teeth


def test_per_layer_windows_and_rope_tables():
    base = dict(vocab_size=10, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                head_dim=8)
    cfg = ModelConfig(architecture="mistral", sliding_window=4, **base)
    assert [cfg.layer_window(i) for i in range(3)] == [4, 4, 4]
    assert [cfg.layer_rope(i) for i in range(3)] == ["global"] * 3
    cfg = ModelConfig(architecture="gemma3", qk_norm=True, sliding_window=4, rope_local_theta=1e4,
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"), **base)
    assert [cfg.layer_window(i) for i in range(3)] == [4, None, 4]
    assert [cfg.layer_rope(i) for i in range(3)] == ["local", "global", "local"]
    probe = cfg.with_layers(5)  # what the memory plan compiles: full attention bounds a window's memory
    assert probe.num_layers == 5 and all(probe.layer_window(i) is None for i in range(5))
    assert ModelConfig(architecture="qwen2", **base).layer_window(0) is None
    with pytest.raises(ValueError, match="layer_types must hold num_layers=3"):
        ModelConfig(architecture="qwen2", sliding_window=4, layer_types=("full_attention",), **base)
    with pytest.raises(ValueError, match="sliding_window is None"):
        ModelConfig(architecture="qwen2", layer_types=("sliding_attention",) * 3, **base)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig(architecture="mistral", sliding_window=0, **base)
    with pytest.raises(ValueError, match="HF LlamaForCausalLM has no sliding-window"):
        ModelConfig(architecture="llama", sliding_window=4, **base).to_hf_dict()


def _gemma(num_layers=4, window=5, **kw):
    from areal_jax.testing import models as testing

    types = tuple("full_attention" if i % 3 == 1 else "sliding_attention" for i in range(num_layers))
    cfg = testing.tiny_config("gemma3", num_layers=num_layers, qk_norm=True, sliding_window=window,
                              layer_types=types, rope_local_theta=10000.0, rope_theta=1e6,
                              query_pre_attn_scalar=24.0, tie_word_embeddings=True, **kw)
    return testing.random_model(cfg, seed=1)


@pytest.mark.parametrize("attention", ["dense", "blocked", "flash"])
def test_packed_rows_of_a_sliding_model_equal_separate_sequences(attention):
    """Gemma-form model (sliding and full layers, their own RoPE tables): two sequences packed in one 384-token
    row (and padding) give each sequence's own logits, whichever attention backend runs the layers."""
    model = _gemma()
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, 97, 150), rng.integers(0, 97, 200)
    row = np.zeros((1, 384), np.int32)
    row[0, :150], row[0, 150:350] = a, b
    seg = np.zeros((1, 384), np.int32)
    seg[0, :150], seg[0, 150:350] = 1, 2
    pos = np.zeros((1, 384), np.int32)
    pos[0, :150], pos[0, 150:350] = np.arange(150), np.arange(200)
    h = model.hidden(jnp.asarray(row), jnp.asarray(pos), jnp.asarray(seg), attention=attention)
    packed = np.asarray(model.unembed(h))[0]
    np.testing.assert_allclose(packed[:150], np.asarray(model(jnp.asarray(a[None])))[0], atol=1e-4)
    np.testing.assert_allclose(packed[150:350], np.asarray(model(jnp.asarray(b[None])))[0], atol=1e-4)


def test_scanned_layers_equal_the_loop_with_uniform_windows():
    from areal_jax.testing import models as testing

    model = testing.random_model(testing.tiny_config("mistral", num_layers=3, sliding_window=6), seed=2)
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 97, (2, 40)), jnp.int32)
    scanned = model.hidden(tokens, scan_layers=True, attention="dense")
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(model.hidden(tokens, attention="dense")), atol=1e-5)
    full = testing.random_model(testing.tiny_config("mistral", num_layers=3), seed=2)
    assert np.abs(np.asarray(full(tokens)) - np.asarray(model(tokens))).max() > 1e-2  # the window has teeth


def test_decoding_over_a_dense_cache_and_pages_equals_the_full_forward():
    """Prefill then one token at a time, past several windows: the dense KV cache and the paged cache (gather
    path, and the kernel path whose sliding layers read through the gather) give the full forward's logits."""
    from areal_jax.models.paged_attention import init_paged_cache, paged_hidden
    from areal_jax.models.transformer import init_cache

    model = _gemma()
    seq = np.random.default_rng(9).integers(0, 97, 24).astype(np.int32)
    want = np.asarray(model(jnp.asarray(seq[None])))[0]
    prompt = 7
    cache = init_cache(model.cfg, 1, 32)
    logits, cache = model(jnp.asarray(seq[None, :prompt]), cache=cache)
    got = [np.asarray(logits)[0]]
    for p in range(prompt, len(seq)):
        logits, cache = model(jnp.asarray(seq[None, p:p + 1]), jnp.asarray([[p]], jnp.int32), cache=cache)
        got.append(np.asarray(logits)[0])
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4)
    table = jnp.asarray([[3, 0, 5, 1, 7, 2, 4, 6]], jnp.int32)
    for path in ("gather", "kernel"):
        pages = init_paged_cache(model.cfg, 8, 4)
        h, pages = paged_hidden(model, jnp.asarray(seq[None, :prompt]), jnp.arange(prompt)[None], pages, table)
        got = [np.asarray(model.unembed(h))[0]]
        for p in range(prompt, len(seq)):
            h, pages = paged_hidden(model, jnp.asarray(seq[None, p:p + 1]), jnp.asarray([[p]], jnp.int32), pages,
                                    table, path=path, interpret=True)
            got.append(np.asarray(model.unembed(h))[0])
        np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4, err_msg=path)


@pytest.mark.parametrize("paged", [False, True])
def test_sampler_loop_decodes_a_sliding_model_as_its_full_forward(paged):
    """A Gemma-form model through the SamplerLoop (k-step dispatches, batched prefill; dense cache, or pages
    whose sliding layers read through the gather): greedy completions past several windows equal greedy
    decoding by full forward passes, and their logprobs equal that forward's."""
    from flax import nnx

    from areal_jax.sampler.engine import Engine
    from areal_jax.sampler.paged_engine import PagedEngine
    from areal_jax.sampler.requests import Request
    from areal_jax.testing.sampler import full_forward_logp, greedy_reference, serve

    model = _gemma(num_layers=3)
    _, params = nnx.split(model)
    engine = (PagedEngine(model, num_slots=2, max_len=40, page_size=4) if paged
              else Engine(model, num_slots=2, max_len=40))
    prompts = [[5, 9, 13, 2, 40, 41, 42, 43, 44], [7, 30], [11, 12, 13]]
    done = serve(engine, params, [Request(id=i, prompt=p, max_new_tokens=20, temperature=0.0)
                                  for i, p in enumerate(prompts)], decode_steps=4)
    logp = full_forward_logp(model, 40)
    for completion, prompt in zip(done, prompts):
        tokens, lps, _ = greedy_reference(logp, prompt, 20)
        assert list(completion.tokens) == tokens
        np.testing.assert_allclose(completion.logprobs, lps, atol=1e-4)
