"""The decode dispatch as GPUs run it never stops the device: no branch on data, only loops of a known trip count.

On GPUs XLA runs a `conditional` by copying its predicate to the host and waiting for the stream, and a `while`
whose trip count it cannot read off the condition the same way before every trip. The dispatch is compiled here
(on the CPU, with the GPU's `counted_loop=True`) and its optimized HLO read; the tests below also check that what
replaced the branches (static sampling filters, a placement step without a branch, k trips always) gives the
tokens the branches gave.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.sampler import Engine, SamplingParams, sample_tokens
from areal_jax.sampler.introspect import decode_steps_program
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.sampler.sampling import NO_FILTERS, SamplingFilters
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import fill_slots_then_stage, full_forward_logp, greedy_reference

MAX_LEN = 64  # within one CPU cache chunk: the attention reads the cache in one pass, without a loop
CFG = testing.tiny_config("qwen3")
SAMPLINGS = {"greedy": [SamplingParams(temperature=0.0)],
             "filtered": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)]}


@pytest.fixture(scope="module")
def model():
    return testing.random_model(CFG, seed=0)


def control_flow(engine, params, k=4):
    """(conditionals, loops whose trip count XLA does not know) in the compiled k-step dispatch."""
    hlo = decode_steps_program(engine, params, k).as_text()
    loops = re.findall(r"^.* while\(.*$", hlo, flags=re.M)
    assert loops, "the k-step loop is missing from the program"
    return len(re.findall(r" conditional\(", hlo)), [w[:160] for w in loops if "known_trip_count" not in w]


@pytest.mark.parametrize("engine_cls", [Engine, PagedEngine])
@pytest.mark.parametrize("standby_rows", [0, 2])
@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_the_dispatch_holds_no_branch_and_only_counted_loops(model, engine_cls, standby_rows, sampling):
    kw = dict(page_size=4, num_pages=64) if engine_cls is PagedEngine else {}
    engine = engine_cls(model, num_slots=4, max_len=MAX_LEN, standby_rows=standby_rows, counted_loop=True, **kw)
    for sp in SAMPLINGS[sampling]:
        engine.settings(sp)
    conditionals, uncounted = control_flow(engine, nnx.split(model)[1])
    assert conditionals == 0 and not uncounted, uncounted
    # Where the condition costs no wait (CPU: the host evaluates it anyway; TPU: the device), the k-step loop
    # still ends once every slot is done: that loop is the one without a known trip count, nothing else.
    engine.counted_loop = False
    engine._build_state_programs()  # fresh programs: the old ones' traces are cached
    conditionals, uncounted = control_flow(engine, nnx.split(model)[1])
    assert conditionals == 0 and len(uncounted) == 1, uncounted


def test_a_cache_longer_than_one_chunk_adds_only_counted_loops_and_decodes_the_reference(model):
    """With a cache of two CPU chunks the attention loops over chunks in every layer: with the GPU's form
    (``counted_loop``) those loops read both chunks for a known trip count; the early-stopping form adds one
    data-dependent loop per layer. A prompt ending just before the chunk boundary decodes across it to the
    full-forward greedy tokens in both forms, the other slot's short context sharing the dispatch."""
    max_len, steps = 256, 8  # 2 chunks of 128 positions on the CPU
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, CFG.vocab_size, size=124).tolist(), [5, 6, 7]]
    logp = full_forward_logp(model, max_len)
    params = nnx.split(model)[1]
    for counted in (True, False):
        engine = Engine(model, num_slots=2, max_len=max_len, counted_loop=counted)
        engine.settings(SamplingParams(temperature=0.0))
        conditionals, uncounted = control_flow(engine, params, k=steps)
        assert conditionals == 0 and len(uncounted) == (0 if counted else CFG.num_layers + 1), uncounted
        state = engine.insert_sequences(params, engine.init_decode_state(), [0, 1], prompts,
                                        [SamplingParams(temperature=0.0, max_new_tokens=steps)] * 2)
        state, r = engine.generate_steps(params, state, np.zeros((steps, 2), np.uint32))
        r = r.to_host()
        for slot, prompt in enumerate(prompts):
            want, want_lp, _ = greedy_reference(logp, prompt, steps)
            assert r.tokens[:, slot].tolist() == want, (counted, slot)
            np.testing.assert_allclose(r.logprobs[:, slot], want_lp, atol=1e-4)


def test_static_filters_draw_the_tokens_the_device_side_skips_draw():
    rng = np.random.default_rng(0)
    rows = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.6), (0.8, 7, 0.9), (0.0, 3, 0.5)]
    logits = jnp.asarray(rng.normal(size=(len(rows), 33)).astype(np.float32) * 3.0)
    t, k, p = (jnp.asarray([r[i] for r in rows], dtype) for i, dtype in enumerate((jnp.float32, jnp.int32,
                                                                                   jnp.float32)))
    needed = NO_FILTERS
    for temp, top_k, top_p in rows:
        needed = needed | SamplingFilters.of(SamplingParams(temperature=temp, top_k=top_k, top_p=top_p))
    assert needed == SamplingFilters(True, True, True)
    step = jax.jit(sample_tokens, static_argnames="filters")
    for seed in range(5):
        key = jax.random.key(seed)
        want = step(logits, key, t, k, p, filters=None)
        for filters in (needed, SamplingFilters()):
            got = step(logits, key, t, k, p, filters=filters)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_allclose(got[1], want[1], atol=1e-6)
    greedy = jnp.zeros_like(t)  # an all-greedy batch needs no transform at all
    np.testing.assert_array_equal(step(logits, key, greedy, k, p, filters=NO_FILTERS)[0], jnp.argmax(logits, -1))
    # Top-k alone, top-p alone: each is the one transform its rows need.
    assert SamplingFilters.of(SamplingParams(top_k=3)) == SamplingFilters(True, False, True)
    assert SamplingFilters.of(SamplingParams(top_p=0.5)) == SamplingFilters(False, True, True)
    assert SamplingFilters.of(SamplingParams(temperature=0.0, top_k=3, top_p=0.5)) == NO_FILTERS


def test_a_request_needing_a_filter_widens_the_compiled_dispatch(model):
    """A greedy-only engine compiles without noise or filters; a top-k = 1 request admitted later must still
    draw only the argmax (without top-k in the program it would draw from the whole vocabulary)."""
    engine = Engine(model, num_slots=2, max_len=MAX_LEN)
    params = nnx.split(model)[1]
    logp = full_forward_logp(model, MAX_LEN)
    state = engine.insert_sequences(params, engine.init_decode_state(), [0], [[4, 5, 6]],
                                    [SamplingParams(temperature=0.0, max_new_tokens=4)])
    state, _ = engine.generate_steps(params, state, np.zeros((4, 2), np.uint32))
    assert engine.sampling_filters == NO_FILTERS
    top1 = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8)
    state = engine.insert_sequences(params, state, [1], [[7, 8, 9, 10]], [top1])
    assert engine.sampling_filters == SamplingFilters(top_k=True, top_p=False, noise=True)
    ks = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 8)))
    state, r = engine.generate_steps(params, state, ks)
    r = r.to_host()
    want, _, _ = greedy_reference(logp, [7, 8, 9, 10], 8)
    assert r.tokens[:, 1].tolist() == want
    np.testing.assert_allclose(r.logprobs[:, 1], 0.0, atol=1e-6)  # top-1 leaves one token: probability 1


def test_idle_steps_after_every_slot_is_done_leave_the_engine_fit_for_the_next_request(model):
    """Two slots free at the same step and two staged rows take them before the next step; every sequence decodes
    its greedy reference. The dispatch runs its 12 steps though every slot is done after 6 (``steps`` counts 6),
    and what the idle steps wrote does not reach the next request."""
    engine = Engine(model, num_slots=2, max_len=MAX_LEN, standby_rows=2, standby_len=16, counted_loop=True)
    params = nnx.split(model)[1]
    logp = full_forward_logp(model, MAX_LEN)
    prompts, budgets = [[5, 6, 7], [9, 10, 11, 12], [3, 4], [20, 21, 22]], [2, 2, 4, 3]
    state = fill_slots_then_stage(engine, params, prompts, budgets)
    state, r = engine.generate_steps(params, state, np.zeros((12, 2), np.uint32))
    r = r.to_host()
    assert r.placed_slot.tolist() == [0, 1] and r.placed_step.tolist() == [2, 2]
    assert int(r.steps) == 6 and r.valid[:6].any(axis=1).all() and not r.valid[6:].any() and r.done.all()
    for slot, spans in {0: [(0, 0), (2, 2)], 1: [(0, 1), (2, 3)]}.items():
        for start, i in spans:
            want, want_lp, _ = greedy_reference(logp, prompts[i], budgets[i])
            assert r.tokens[start:start + budgets[i], slot].tolist() == want
            np.testing.assert_allclose(r.logprobs[start:start + budgets[i], slot], want_lp, atol=1e-4)
    engine.standby_moved([(0, 0), (1, 1)])
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5)
    state = engine.insert(engine.prefill(params, [30, 31]), state, 0, sampling)
    state, r = engine.generate_steps(params, state, np.zeros((5, 2), np.uint32))
    assert r.to_host().tokens[:, 0].tolist() == greedy_reference(logp, [30, 31], 5)[0]
