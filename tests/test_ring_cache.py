"""Ring caches of sliding-window layers: a sliding layer's decode slots hold only its window (position p at index
p % R), and decoding over them equals decoding over full-length rows and the model's full forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.cache_attention import ring_attention, ring_length
from areal_jax.models.transformer import cache_lengths, init_cache
from areal_jax.sampler.prefill import ring_rows, write_rows


def _gemma(num_layers=4, window=5):
    from areal_jax.testing import models as testing

    types = tuple("full_attention" if i % 3 == 1 else "sliding_attention" for i in range(num_layers))
    cfg = testing.tiny_config("gemma3", num_layers=num_layers, qk_norm=True, sliding_window=window,
                              layer_types=types, rope_local_theta=10000.0, rope_theta=1e6,
                              query_pre_attn_scalar=24.0, tie_word_embeddings=True)
    return testing.random_model(cfg, seed=1)


def test_ring_rows_by_hand():
    """Rows of positions 0..P-1 with 7 and 3 real positions, as rings of 4: index j holds the last real position
    congruent to j mod 4 (position 0's copy where none is)."""
    src = jnp.arange(2 * 10, dtype=jnp.float32).reshape(2, 10, 1, 1) + jnp.asarray([0, 100.0])[:, None, None, None]
    got = np.asarray(ring_rows(src, jnp.asarray([7, 3]), 4))[..., 0, 0]
    np.testing.assert_array_equal(got[0], [4, 5, 6, 3])  # positions 4, 5, 6 and 3 (7 real: 0..6)
    np.testing.assert_array_equal(got[1], [110, 111, 112, 110])  # 0, 1, 2; index 3 unreached


def test_cache_lengths_and_ring_length():
    model = _gemma(num_layers=4, window=5)
    assert ring_length(5, 40) == 8 and ring_length(300, 40) == 40 and ring_length(512, 8192) == 512
    assert cache_lengths(model.cfg, 40) == (40, 40, 40, 40)
    assert cache_lengths(model.cfg, 40, ring=True) == (8, 40, 8, 8)  # layer 1 attends everything
    cache = init_cache(model.cfg, 3, 40, ring=True)
    assert [x.shape[1] for x in cache.k] == [8, 40, 8, 8] and cache.max_len == 40


def test_ring_attention_equals_the_full_row():
    """One query per row at positions on both sides of the ring's length: the ring (filled as the decode fills it)
    gives what a full-length row with the same window gives."""
    from areal_jax.models.cache_attention import cached_attention

    rng = np.random.default_rng(0)
    b, s, kv, h, dh, window = 4, 40, 2, 4, 8, 6
    r = ring_length(window, s)
    k, v = (jnp.asarray(rng.normal(size=(b, s, kv, dh)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(b, 1, h, dh)), jnp.float32)
    positions = jnp.asarray([[0], [5], [8], [37]], jnp.int32)
    # the ring after writing positions 0..p of each row in order: index j holds the last position <= p that is j mod r
    held = positions - jnp.remainder(positions - jnp.arange(r)[None], r)  # [b, r]
    ring_k = jnp.take_along_axis(k, jnp.clip(held, 0)[:, :, None, None], axis=1)
    ring_v = jnp.take_along_axis(v, jnp.clip(held, 0)[:, :, None, None], axis=1)
    want = cached_attention(q, k, v, positions, window=window)
    np.testing.assert_allclose(np.asarray(ring_attention(q, ring_k, ring_v, positions, window)), np.asarray(want),
                               atol=1e-5)
    with pytest.raises(ValueError, match="one query per row"):
        ring_attention(jnp.concatenate([q, q], 1), ring_k, ring_v, jnp.concatenate([positions] * 2, 1), window)


def test_decoding_over_rings_equals_the_full_forward():
    """Two rows (prompts of 11 and 3 tokens, one longer than the ring of 8) prefilled into full-length rows, copied
    into a ring cache (`write_rows`), then decoded a token at a time well past the window: every step's logits
    equal the full forward's. A multi-token call on a ring cache is refused."""
    model = _gemma()
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 97, 30).astype(np.int32) for _ in range(2)]
    prompts = [11, 3]
    want = [np.asarray(model(jnp.asarray(s[None])))[0] for s in seqs]
    tokens = np.zeros((2, 16), np.int32)
    for r, n in enumerate(prompts):
        tokens[r, :n] = seqs[r][:n]
    _, full = model(jnp.asarray(tokens), cache=init_cache(model.cfg, 2, 16))
    cache = write_rows(init_cache(model.cfg, 2, 40, ring=True), full, jnp.arange(2), jnp.asarray(prompts))
    assert [x.shape[1] for x in cache.k] == [8, 40, 8, 8]
    lengths = list(prompts)
    for _ in range(30 - max(prompts)):
        step = jnp.asarray([[seqs[r][lengths[r]]] for r in range(2)], jnp.int32)
        logits, cache = model(step, jnp.asarray([[n] for n in lengths], jnp.int32), cache=cache, ring=True)
        for r in range(2):
            np.testing.assert_allclose(np.asarray(logits)[r, 0], want[r][lengths[r]], atol=1e-4)
        lengths = [n + 1 for n in lengths]
    with pytest.raises(ValueError, match="one token per row"):
        model(jnp.asarray(tokens[:, :2]), cache=cache, ring=True)
    with pytest.raises(ValueError, match="ring=True"):
        model(step, cache=init_cache(model.cfg, 2, 40), ring=True)


def _serve(engine, params, prompts, budget, **kw):
    from areal_jax.sampler.requests import Request
    from areal_jax.testing.sampler import serve

    return serve(engine, params, [Request(id=i, prompt=p, max_new_tokens=budget, temperature=0.0)
                                  for i, p in enumerate(prompts)], **kw)


@pytest.mark.parametrize("standby", [0, 2])
def test_engine_ring_cache_equals_full_rows_and_the_full_forward(standby):
    """The SamplerLoop over an Engine whose sliding layers are rings (the default) and over one with full-length
    rows: more prompts than slots (admissions into freed slots, or standby rows placed inside a dispatch), prompts
    longer and shorter than the ring, completions past several windows. Both give greedy decoding by full forwards,
    and the ring engine's sliding layers hold 8 positions per slot instead of 48."""
    from areal_jax.sampler.engine import Engine
    from areal_jax.testing.sampler import full_forward_logp, greedy_reference

    model = _gemma(num_layers=3)
    _, params = nnx.split(model)
    prompts = [[5, 9, 13, 2, 40, 41, 42, 43, 44, 45, 46, 47], [7, 30], [11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    kw = dict(num_slots=2, max_len=48, standby_rows=standby)
    ring = Engine(model, **kw)
    full = Engine(model, ring_cache=False, **kw)
    shapes = [x.shape[1] for x in jax.eval_shape(ring._init_fn).cache.k]
    assert shapes == [8, 48, 8] and [x.shape[1] for x in jax.eval_shape(full._init_fn).cache.k] == [48] * 3
    got = _serve(ring, params, prompts, 24, decode_steps=4)
    ref = _serve(full, params, prompts, 24, decode_steps=4)
    logp = full_forward_logp(model, 48)
    for a, b, prompt in zip(got, ref, prompts):
        tokens, lps, _ = greedy_reference(logp, prompt, 24)
        assert list(a.tokens) == list(b.tokens) == tokens
        np.testing.assert_allclose(a.logprobs, lps, atol=1e-4)


def test_recompute_into_rings_equals_full_rows():
    """`insert_sequences` (the re-prefill of in-flight sequences after a weight update) writes sequences longer
    than the ring into ring slots: the next steps' tokens and logprobs equal those of full-length rows."""
    from areal_jax.sampler.engine import Engine
    from areal_jax.sampler.sampling import SamplingParams

    model = _gemma(num_layers=3)
    _, params = nnx.split(model)
    seqs = [[5, 9, 13, 2, 40, 41, 42, 43, 44, 45, 46, 47, 50, 51, 52, 53, 54, 55], [7, 30, 31]]
    samplings = [SamplingParams(temperature=0.0, max_new_tokens=12)] * 2
    out = []
    for ring in (True, False):
        engine = Engine(model, num_slots=3, max_len=48, ring_cache=ring)
        state = engine.insert_sequences(params, engine.init_decode_state(), [2, 0], seqs, samplings)
        keys = np.zeros((10, 2), np.uint32)
        state, result = engine.generate_steps(params, state, keys)
        result = result.to_host()
        out.append((result.tokens[:, [2, 0]], result.logprobs[:, [2, 0]]))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_allclose(out[0][1], out[1][1], atol=1e-5)


@pytest.mark.parametrize("path", ["gather", "kernel"])
def test_paged_engine_keeps_sliding_layers_in_rings(path):
    """A PagedEngine over a Gemma-form model: the sliding layers have no pages, only rings per slot and standby
    row, the full layer keeps its pages; the SamplerLoop's greedy completions (standby rows, prompts longer than the
    ring, completions past several windows; the full layer through the gather or the interpreted kernel) equal
    greedy decoding by full forwards and those of the engine without rings."""
    from areal_jax.sampler.paged_engine import PagedEngine
    from areal_jax.testing.sampler import full_forward_logp, greedy_reference

    model = _gemma(num_layers=3)
    _, params = nnx.split(model)
    prompts = [[5, 9, 13, 2, 40, 41, 42, 43, 44, 45, 46, 47], [7, 30], [11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    kw = dict(num_slots=2, max_len=48, page_size=4, standby_rows=2, attention=path)
    engine = PagedEngine(model, **kw)
    shapes = jax.eval_shape(engine._init_fn)
    assert [x.shape[1] for x in shapes.cache.pages.k] == [0, engine.num_pages, 0]
    assert [x.shape[:2] for x in shapes.cache.rings.k] == [(2, 8), (2, 0), (2, 8)]
    assert [x.shape[:2] for x in shapes.standby.cache.rings.k] == [(2, 8), (2, 0), (2, 8)]
    got = _serve(engine, params, prompts, 24, decode_steps=4)
    ref = _serve(PagedEngine(model, ring_cache=False, **kw), params, prompts, 24, decode_steps=4)
    logp = full_forward_logp(model, 48)
    for a, b, prompt in zip(got, ref, prompts):
        tokens, lps, _ = greedy_reference(logp, prompt, 24)
        assert list(a.tokens) == list(b.tokens) == tokens
        np.testing.assert_allclose(a.logprobs, lps, atol=1e-4)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_memory_plan_counts_the_rings_as_allocated(kv_cache):
    """`system.memory.kv_cache_bytes` of a rollout section equals the bytes of the decode state its engine
    allocates (cache, rings, standby rows, logits: every leaf but the small per-row fields), and it is below that of
    the same model without windows."""
    from areal_jax.sampler.config import RolloutConfig
    from areal_jax.system.memory import kv_cache_bytes

    model = _gemma(num_layers=6, window=5)
    rollout = RolloutConfig(num_slots=4, group_size=2, max_len=64, kv_cache=kv_cache, page_size=4, kv_pages=40, standby_rows=2,
                            standby_len=16)
    engine = rollout.make_engine(model, mesh=None, config=model.cfg)
    state = jax.eval_shape(engine._init_fn)

    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim >= 2 and x.dtype != jnp.int32)

    allocated = nbytes(state.cache) + nbytes(state.logits) + nbytes(state.standby.cache) + nbytes(state.standby.logits)
    assert kv_cache_bytes(model.cfg, rollout, 1) == allocated
    full = _gemma(num_layers=6, window=64)  # no window shorter than max_len: no rings
    assert kv_cache_bytes(model.cfg, rollout, 1) < kv_cache_bytes(full.cfg, rollout, 1)
