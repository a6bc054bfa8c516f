"""Standby rows over the paged KV cache: a staged row's prompt lives in pool pages, its table row moves into the
slot it takes, and the host moves the pages when it learns of the move."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_jax.sampler import Engine, Request, SamplerLoop, SamplingParams
from areal_jax.sampler.introspect import decode_steps_program
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import (
    collect_completions,
    full_forward_logp,
    greedy_reference,
    on_each_dispatch,
    serve,
    submit_all,
    token_logp_errors,
)

MAX_LEN = 48
CFG = testing.tiny_config("qwen2")


@pytest.fixture(scope="module")
def model():
    return testing.random_model(CFG, seed=0)


def greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n)


def test_page_table_travels_inside_each_program_and_a_fresh_state_starts_from_a_fresh_table(model, monkeypatch):
    """The host's page table reaches the device inside the program that needs it: the paged engine runs as many
    device programs as the dense engine for the same calls (no upload dispatch of its own), gives the same tokens,
    and after init_decode_state the same calls give the same tokens again (no table left from the run before)."""
    params = nnx.split(model)[1]
    programs = []
    call = Engine._call
    monkeypatch.setattr(Engine, "_call", lambda self, fn, *a, **k: (programs.append(type(self)), call(self, fn, *a, **k))[1])

    def run(engine):
        state = engine.init_decode_state()
        prefixes = [engine.prefill(params, p) for p in ([5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 30)))]
        del programs[:]
        state = engine.insert(prefixes[0], state, 0, greedy(2))
        state = engine.insert(prefixes[1], state, 1, greedy(12))
        state = engine.stage(prefixes[2], state, [0, 1, 2], greedy(4))
        state, first = engine.generate_steps(params, state, np.zeros((8, 2), np.uint32))
        first = first.to_host()
        state = engine.release(state, [1])  # slot 1 stops (its pages go back); slot 0 runs on with a staged row
        state, second = engine.generate_steps(params, state, np.zeros((6, 2), np.uint32))
        return len(programs), first.tokens, second.to_host().tokens

    dense = run(Engine(model, num_slots=2, max_len=MAX_LEN, standby_rows=3))
    engine = PagedEngine(model, num_slots=2, max_len=MAX_LEN, page_size=4, num_pages=40, standby_rows=3)
    paged = run(engine)
    again = run(engine)
    assert paged[0] == dense[0] == 6
    for got in (paged, again):
        np.testing.assert_array_equal(got[1], dense[1])
        np.testing.assert_array_equal(got[2], dense[2])


def test_the_dispatch_a_probe_compiles_is_the_one_the_engine_runs(model):
    """`decode_steps_program` (what the memory probe and the benchmarks read) lowers the paged dispatch with its
    page-table step, as the engine's calls run it: the compiled program takes the host's table (slots and standby
    rows), and run on a live state with that table it gives the engine's own tokens."""
    params = nnx.split(model)[1]
    engine = PagedEngine(model, num_slots=2, max_len=MAX_LEN, page_size=4, num_pages=40, standby_rows=3)
    engine.settings(greedy(6))
    compiled = decode_steps_program(engine, params, 6)
    state = engine.init_decode_state()
    state = engine.insert(engine.prefill(params, [5, 6, 7, 8, 9]), state, 0, greedy(6))
    state = engine.stage(engine.prefill(params, [11, 12, 13]), state, [0, 1], greedy(3))
    keys = np.zeros((6, 2), np.uint32)
    engine._grow(len(keys))  # the pages of the dispatch's growth, as generate_steps takes them first
    table = engine._program_kwargs(engine._jit_generate_steps)
    assert table["table"].shape == (2 + 3, engine.pages_per_slot)
    copy = jax.tree.map(jnp.copy, state)
    _, probed = compiled(engine.place_params(params), copy, keys, **table)
    _, ran = engine.generate_steps(params, state, keys)
    np.testing.assert_array_equal(probed.to_host().tokens, ran.to_host().tokens)
    assert (ran.to_host().tokens[:, 1] >= 0).any()  # the staged row took slot 1 inside the dispatch


def test_staged_group_shares_prompt_pages_and_rows_move_into_slots_with_their_pages(model):
    logp = full_forward_logp(model, MAX_LEN)
    params = nnx.split(model)[1]
    engine = PagedEngine(model, num_slots=2, max_len=MAX_LEN, page_size=4, num_pages=40, standby_rows=3)
    a, b, g = [5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 30))  # g: 2 full pages and a partial one
    state = engine.init_decode_state()
    state = engine.insert(engine.prefill(params, a), state, 0, greedy(2))
    state = engine.insert(engine.prefill(params, b), state, 1, greedy(12))
    state = engine.stage(engine.prefill(params, g), state, [0, 1, 2], greedy(4))
    table = engine.allocator.table
    staged = table[2:5].copy()  # allocator rows 2..4 are the standby rows
    assert (staged[:, :2] == staged[0, :2]).all() and len(set(staged[:, 2].tolist())) == 3
    assert engine.allocator.refcount[staged[0, :2]].tolist() == [3, 3]

    state, r = engine.generate_steps(params, state, np.zeros((8, 2), np.uint32))
    r = r.to_host()
    # Slot 0: a for 2 steps, then row 0 (4 steps), then row 1 from step 6; row 2 still waits. Slot 1: b throughout.
    assert r.placed_slot.tolist() == [0, 0, 2] and r.placed_step.tolist()[:2] == [2, 6]
    want_g = greedy_reference(logp, g, 4)[0]
    assert r.tokens[:2, 0].tolist() == greedy_reference(logp, a, 2)[0]
    assert r.tokens[2:6, 0].tolist() == want_g and r.tokens[6:8, 0].tolist() == want_g[:2]
    row1_pages = engine.allocator.table[3].copy()
    assert (np.asarray(state.cache.table)[0] == row1_pages).all(), "the device moved row 1's table row into slot 0"

    engine.standby_moved([(0, 0), (1, 0)])  # the host learns of both moves, in order
    assert (engine.allocator.table[0] == row1_pages).all() and (engine.allocator.table[2:4] == -1).all()
    assert engine.allocator.refcount[staged[0, :2]].tolist() == [2, 2]  # row 0's sample finished: one reader less
    state, r = engine.generate_steps(params, state, np.zeros((8, 2), np.uint32))
    r = r.to_host()
    assert (np.asarray(state.cache.table)[0] == engine.allocator.table[4]).all()
    assert r.tokens[:2, 0].tolist() == want_g[2:] and r.tokens[2:6, 0].tolist() == want_g
    assert r.tokens[:4, 1].tolist() == greedy_reference(logp, b, 12)[0][8:] and r.done.all()
    engine.standby_moved([(2, 0)])
    engine.finished(0)
    engine.finished(1)
    assert engine.allocator.free_pages == 40 and not engine.allocator.refcount.any()


@pytest.fixture(scope="module")
def engines(model):
    # A pool of 24 pages of 4 positions: about three of the longest sequences at once, so reservations, not
    # slots, often decide what is inserted or staged.
    return (Engine(model, num_slots=3, max_len=MAX_LEN),
            PagedEngine(model, num_slots=3, max_len=MAX_LEN, page_size=4, num_pages=24, standby_rows=3),
            nnx.split(model)[1])


request_mix = st.lists(st.tuples(st.integers(1, 13), st.integers(1, 14), st.integers(1, 3), st.booleans()),
                       min_size=2, max_size=7)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=request_mix, seed=st.integers(0, 1000), k=st.integers(2, 4), fetch_behind=st.booleans())
def test_paged_standby_gives_the_dense_tokens_and_returns_every_page(engines, mix, seed, k, fetch_behind):
    dense, paged, params = engines
    rng = np.random.default_rng(seed)
    requests = [Request(id=i, prompt=rng.integers(3, CFG.vocab_size, p).tolist(), max_new_tokens=m, n=n,
                        temperature=0.0, stop_token_ids=(int(rng.integers(3, CFG.vocab_size)),) if stop else ())
                for i, (p, m, n, stop) in enumerate(mix)]
    want = serve(dense, params, requests, decode_steps=3)
    got = serve(paged, params, requests, decode_steps=k, fetch_behind=fetch_behind)
    for a, b in zip(want, got):
        assert (a.request_id, a.sample_index, a.finish_reason) == (b.request_id, b.sample_index, b.finish_reason)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert paged.allocator.free_pages == 24 and not paged.allocator.refcount.any()


@pytest.fixture(scope="module")
def standby_engines(model):
    return {"dense": Engine(model, num_slots=3, max_len=MAX_LEN, standby_rows=3),
            "paged": PagedEngine(model, num_slots=3, max_len=MAX_LEN, page_size=4, num_pages=24, standby_rows=3)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=request_mix, aborted=st.sets(st.integers(0, 6)), seed=st.integers(0, 1000), kind=st.sampled_from(
    ["dense", "paged"]), hook_at=st.integers(0, 3))
def test_aborts_mid_dispatch_cost_only_the_aborted_requests(engines, standby_engines, mix, aborted, seed, kind,
                                                            hook_at):
    dense, _, params = engines
    rng = np.random.default_rng(seed)
    requests = [Request(id=i, prompt=rng.integers(3, CFG.vocab_size, p).tolist(), max_new_tokens=m, n=n,
                        temperature=0.0) for i, (p, m, n, _) in enumerate(mix)]
    want = {(c.request_id, c.sample_index): c for c in serve(dense, params, requests, decode_steps=3)}
    engine = standby_engines[kind]
    loop = SamplerLoop(engine, params, decode_steps=3)

    def abort(n):  # the aborts arrive while dispatch number hook_at is in flight
        for i in aborted if n == hook_at else ():
            loop.abort(i)

    try:
        with on_each_dispatch(engine, abort):
            submit_all(loop, requests)
            got = collect_completions(loop, sum(r.n for r in requests))
            stats = loop.stats()
    finally:
        loop.stop(graceful=False)
    for c in got:
        ref = want[(c.request_id, c.sample_index)]
        if c.finish_reason == "interrupted":
            assert c.request_id in aborted and c.tokens.tolist() == ref.tokens[: len(c.tokens)].tolist()
        else:  # finished: every token, whether or not its request was aborted later
            assert c.finish_reason == ref.finish_reason and c.tokens.tolist() == ref.tokens.tolist()
    assert stats["running"] == stats["standby"] == 0
    if kind == "paged":
        assert engine.allocator.free_pages == 24 and not engine.allocator.refcount.any()


@pytest.fixture(scope="module")
def second_model():
    return testing.random_model(CFG, seed=1)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=request_mix, seed=st.integers(0, 1000), kind=st.sampled_from(["dense", "paged"]), hook_at=st.integers(0, 4))
def test_a_recompute_update_mid_dispatch_keeps_every_token_exact_under_its_version(
        model, second_model, standby_engines, mix, seed, kind, hook_at):
    rng = np.random.default_rng(seed)
    requests = [Request(id=i, prompt=rng.integers(3, CFG.vocab_size, p).tolist(), max_new_tokens=m, n=n)
                for i, (p, m, n, _) in enumerate(mix)]  # sampled at temperature 1
    engine = standby_engines[kind]
    loop = SamplerLoop(engine, nnx.split(model)[1], on_update="recompute", decode_steps=3, seed=seed)

    def update(n):  # the new weights arrive while dispatch number hook_at is in flight
        if n == hook_at:
            loop.update_params(nnx.split(second_model)[1], version=5)

    try:
        with on_each_dispatch(engine, update):
            submit_all(loop, requests)
            got = collect_completions(loop, sum(r.n for r in requests))
    finally:
        loop.stop(graceful=False)
    logps = {0: full_forward_logp(model, MAX_LEN), 5: full_forward_logp(second_model, MAX_LEN)}
    for c in got:
        want = next(r for r in requests if r.id == c.request_id)
        assert c.finish_reason == "length" and len(c.tokens) == want.max_new_tokens
        assert np.all(np.diff(c.versions) >= 0) and set(c.versions.tolist()) <= {0, 5}
        assert token_logp_errors(c, logps).max() < 1e-4
    if kind == "paged":
        assert engine.allocator.free_pages == 24 and not engine.allocator.refcount.any()
