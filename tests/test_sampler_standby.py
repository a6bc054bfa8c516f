"""Standby rows: staged requests move into slots inside a dispatch, with the tokens they would get in a slot."""
from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.sampler import Engine, Request, SamplerLoop
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import (
    HookAfterDispatch,
    collect_completions,
    fill_slots_then_stage,
    full_forward_logp,
    greedy_reference,
    run_requests,
    submit_all,
    token_logp_errors,
)

MAX_LEN = 64
CFG = testing.tiny_config("qwen3")


@pytest.fixture(scope="module")
def models():
    return testing.random_model(CFG, seed=0), testing.random_model(CFG, seed=1)


@pytest.fixture(scope="module")
def logp(models):
    return full_forward_logp(models[0], MAX_LEN)


def test_staged_rows_take_slots_the_step_after_they_finish(models, logp):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23], [30, 31, 32]]
    budgets = [3, 7, 2, 5, 4]
    engine = Engine(models[0], num_slots=2, max_len=MAX_LEN, standby_rows=4, standby_len=16)
    params = nnx.split(models[0])[1]
    state = fill_slots_then_stage(engine, params, prompts, budgets)
    state, r = engine.generate_steps(params, state, np.zeros((16, 2), np.uint32))
    r = r.to_host()
    # Slot 0 runs request 0 (3 tokens), then request 2 from step 3 (2 tokens), then request 3 from step 5; slot 1
    # runs request 1 (7 tokens), then request 4 from step 7. Row 3 held nothing and stays put (slot index 2 = none).
    assert r.placed_slot.tolist() == [0, 0, 1, 2] and r.placed_step.tolist()[:3] == [3, 5, 7]
    spans = {0: [(0, 0), (3, 2), (5, 3)], 1: [(0, 1), (7, 4)]}
    for slot, span in spans.items():
        for (start, i), end in zip(span, [s for s, _ in span[1:]] + [16]):
            want, want_lp, _ = greedy_reference(logp, prompts[i], budgets[i])
            assert r.valid[start:end, slot].tolist() == [True] * budgets[i] + [False] * (end - start - budgets[i])
            assert r.tokens[start:start + budgets[i], slot].tolist() == want
            np.testing.assert_allclose(r.logprobs[start:start + budgets[i], slot], want_lp, atol=1e-4)
    assert int(r.steps) == 11 and r.done.all() and bool(np.asarray(state.standby.done).all())


def make_engine(cls, model, **kwargs):
    """A dense Engine, or a PagedEngine with pages of 4 positions in a pool that holds 2 of its sequences."""
    if issubclass(cls, PagedEngine):
        kwargs.update(page_size=4, num_pages=2 * MAX_LEN // 4)
    return cls(model, max_len=MAX_LEN, **kwargs)


def run_loop(model, requests, standby_rows, decode_steps=4, fetch_behind=True, num_slots=3, engine_cls=Engine):
    engine = make_engine(engine_cls, model, num_slots=num_slots, standby_rows=standby_rows)
    out = run_requests(engine, nnx.split(model)[1], requests, decode_steps=decode_steps, fetch_behind=fetch_behind)
    if engine_cls is PagedEngine:  # every page came back
        assert engine.allocator.free_pages == engine.num_pages and not engine.allocator.refcount.any()
    return out


@pytest.mark.parametrize("fetch_behind,engine_cls", [(True, Engine), (False, Engine), (True, PagedEngine),
                                                     (False, PagedEngine)])
def test_loop_with_standby_gives_the_same_completions_with_fuller_slots(models, fetch_behind, engine_cls):
    stop = 40
    requests = [Request(id=i, prompt=[4 + i, 20, 30 + i], max_new_tokens=n, temperature=0.0,
                        stop_token_ids=(stop,) if i % 3 == 0 else ())
                for i, n in enumerate([5, 11, 2, 7, 9, 4, 13, 3, 6, 8])]
    requests.append(Request(id="g", prompt=[7, 8, 9], max_new_tokens=6, n=3, temperature=0.0))
    base, base_stats = run_loop(models[0], requests, standby_rows=0, fetch_behind=fetch_behind, engine_cls=engine_cls)
    got, stats = run_loop(models[0], requests, standby_rows=2, fetch_behind=fetch_behind, engine_cls=engine_cls)
    for a, b in zip(base, got):
        assert (a.request_id, a.sample_index, a.finish_reason) == (b.request_id, b.sample_index, b.finish_reason)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert (b.versions == 0).all()
    assert stats["generated_tokens"] == base_stats["generated_tokens"]
    assert stats["placed_from_standby"] > 0 and stats["standby"] == 0
    assert stats["steps"] < base_stats["steps"]  # the same tokens in fewer steps: slots idle less
    assert stats["mean_slot_occupancy"] > base_stats["mean_slot_occupancy"]


@pytest.mark.parametrize("on_update,engine_cls", [("recompute", Engine), ("continue", Engine),
                                                  ("recompute", PagedEngine)])
def test_update_with_staged_samples_tags_every_token_with_its_version(models, on_update, engine_cls):
    old, new = models
    engine = make_engine(type("Hooked", (HookAfterDispatch, engine_cls), {}), old, num_slots=2, standby_rows=2)
    engine.at = 2
    loop = SamplerLoop(engine, nnx.split(old)[1], on_update=on_update, seed=3, decode_steps=3)
    engine.hook = lambda: loop.update_params(nnx.split(new)[1], version=7)
    loop.pause()
    for i, n in enumerate([4, 9, 3, 8, 5, 7]):
        loop.submit(Request(id=i, prompt=[5 + i, 17, 23], max_new_tokens=n))
    loop.resume()
    done = collect_completions(loop, 6)
    stats = loop.stats()
    loop.stop()
    assert stats["updates"] == 1 and stats["placed_from_standby"] > 0
    if engine_cls is PagedEngine:
        assert engine.allocator.free_pages == engine.num_pages and not engine.allocator.refcount.any()
    logps = {0: full_forward_logp(old, MAX_LEN), 7: full_forward_logp(new, MAX_LEN)}
    for c in done:
        assert len(c.tokens) == [4, 9, 3, 8, 5, 7][c.request_id] and c.finish_reason == "length"
        assert np.all(np.diff(c.versions) >= 0) and set(c.versions.tolist()) <= {0, 7}
        if on_update == "recompute":  # every token exact under the version it is tagged with
            assert token_logp_errors(c, logps).max() < 1e-4
    assert any(7 in c.versions for c in done) and any(0 in c.versions for c in done)


def test_aborts_of_queued_staged_and_running_samples(models, logp):
    engine = make_engine(type("Hooked", (HookAfterDispatch, Engine), {}), models[0], num_slots=2, standby_rows=2)
    engine.at = 1  # after 3 + 3 decode steps: nothing has finished (the shortest running request needs 10)
    loop = SamplerLoop(engine, nnx.split(models[0])[1], decode_steps=3)
    aborted = (1, 3, 4, 6)  # 1 runs in a slot, 3 is staged, 4 and 6 are queued
    engine.hook = lambda: [loop.abort(i) for i in aborted]
    loop.pause()
    requests = [Request(id=i, prompt=[4 + i, 9, 12], max_new_tokens=n, temperature=0.0)
                for i, n in enumerate([12, 10, 8, 11, 9, 7, 12, 5])]
    for r in requests:
        loop.submit(r)
    loop.resume()
    done = collect_completions(loop, len(requests))
    loop.stop()
    assert sorted(c.request_id for c in done) == list(range(len(requests)))
    for c in done:
        want, _, _ = greedy_reference(logp, requests[c.request_id].prompt, requests[c.request_id].max_new_tokens)
        if c.finish_reason == "interrupted":
            assert c.request_id in aborted and c.tokens.tolist() == want[: len(c.tokens)]
        else:
            assert c.finish_reason == "length" and c.tokens.tolist() == want
    interrupted = {c.request_id for c in done if c.finish_reason == "interrupted"}
    # 3 (staged, 11 tokens) and the queued 4 and 6 cannot finish before the abort lands; 1 may race it
    assert {3, 4, 6} <= interrupted
    assert all(len(c.tokens) == 0 for c in done if c.request_id in (4, 6))  # dropped from the queue
    assert loop.stats()["running"] == loop.stats()["standby"] == 0


def test_pause_with_staged_samples_then_resume(models, logp):
    engine = Engine(models[0], num_slots=2, max_len=MAX_LEN, standby_rows=3)
    loop = SamplerLoop(engine, nnx.split(models[0])[1], decode_steps=2)
    requests = [Request(id=i, prompt=[3 + i, 8], max_new_tokens=6 + i % 3, temperature=0.0) for i in range(9)]
    for r in requests:
        loop.submit(r)
    done = collect_completions(loop, 1)
    loop.pause()  # idle between dispatches: nothing decodes, whatever is staged waits
    paused = loop.stats()
    time.sleep(0.3)
    assert loop.stats()["generated_tokens"] == paused["generated_tokens"]  # nothing decodes while paused
    loop.resume()
    done += collect_completions(loop, 8)
    loop.stop()
    for c in done:
        r = requests[c.request_id]
        assert c.tokens.tolist() == greedy_reference(logp, r.prompt, r.max_new_tokens)[0]


def test_standby_arguments_are_checked(models):
    params = nnx.split(models[0])[1]
    with pytest.raises(ValueError, match="standby_rows must be >= 0"):
        Engine(models[0], num_slots=2, max_len=MAX_LEN, standby_rows=-1)
    with pytest.raises(ValueError, match="standby_len must lie in"):
        Engine(models[0], num_slots=2, max_len=MAX_LEN, standby_rows=1, standby_len=MAX_LEN + 1)
    engine = Engine(models[0], num_slots=2, max_len=MAX_LEN, standby_rows=2, standby_len=16)
    state = engine.init_decode_state()
    long_prefix = engine.prefill(params, list(range(3, 23)))  # bucket 32 > standby_len 16
    assert not engine.can_stage(long_prefix)
    with pytest.raises(ValueError, match="does not fit a standby row"):
        engine.stage(long_prefix, state, [0])
    with pytest.raises(ValueError, match=r"distinct indices in \[0, 2\)"):
        engine.stage(engine.prefill(params, [3, 4]), state, [0, 2])
    assert jax.tree.leaves(state.standby.cache)[0].shape[:2] == (2, 16)


@pytest.mark.parametrize("engine_cls", [Engine, PagedEngine])
def test_abort_of_a_run_that_finished_in_flight_spares_the_row_placed_after_it(models, logp, engine_cls):
    # One slot, one standby row, 4 steps per dispatch. Dispatch 0 runs A (2 tokens), then places B into the slot.
    # A's abort reaches the loop while dispatch 0 is in flight, so the host still believes A holds the slot; its
    # release must not free the slot B now holds: B completes with all of its tokens.
    engine = make_engine(type("Hooked", (HookAfterDispatch, engine_cls), {}), models[0], num_slots=1, standby_rows=1)
    loop = SamplerLoop(engine, nnx.split(models[0])[1], decode_steps=4)
    engine.at, engine.hook = 0, lambda: loop.abort("a")
    loop.pause()
    loop.submit(Request(id="a", prompt=[5, 6, 7], max_new_tokens=2, temperature=0.0))
    loop.submit(Request(id="b", prompt=[9, 10], max_new_tokens=6, temperature=0.0))
    loop.resume()
    done = collect_completions(loop, 2)
    stats = loop.stats()
    loop.stop()
    assert stats["placed_from_standby"] == 1
    if engine_cls is PagedEngine:
        assert engine.allocator.free_pages == engine.num_pages and not engine.allocator.refcount.any()
    assert done[0].request_id == "a" and done[0].finish_reason == "interrupted"
    assert done[1].finish_reason == "length" and done[1].tokens.tolist() == greedy_reference(logp, [9, 10], 6)[0]


class _SpyLoop(SamplerLoop):
    """Records each admission's direct slots while dispatches carrying staged rows were in flight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.direct_with_rows_in_flight = []
        self.admissions_with_rows_in_flight = 0

    def _direct(self):
        out = super()._direct()
        if any(d.standby for d in self._inflight):
            self.admissions_with_rows_in_flight += 1
            if out:
                self.direct_with_rows_in_flight.append((sorted(self._free), list(out)))
        return out


def test_prompts_too_long_for_a_standby_row_wait_for_a_dispatch_without_staged_rows(models, logp):
    # 3-token prompts fit the 8-position standby rows, 12-token ones do not: those are inserted into free slots
    # once no dispatch in flight carries staged rows (such a dispatch may move one into any slot the host believes
    # free). Every sample gets exactly the tokens of a full-forward reference.
    budgets = [2, 9, 3, 3, 12, 2, 5, 2, 2, 7, 4, 3, 2, 9, 2, 6, 3, 2]
    requests = [Request(id=i, prompt=[4 + i] * (12 if i % 3 == 1 else 3), max_new_tokens=n, temperature=0.0)
                for i, n in enumerate(budgets)]
    engine = Engine(models[0], num_slots=5, max_len=MAX_LEN, standby_rows=2, standby_len=8,
                    prefill_buckets=(8, 16, MAX_LEN))
    loop = _SpyLoop(engine, nnx.split(models[0])[1], decode_steps=3, fetch_behind=True)
    submit_all(loop, requests)
    got = collect_completions(loop, len(requests))
    stats = loop.stats()
    loop.stop()
    for c, r in zip(sorted(got, key=lambda c: c.request_id), requests):
        want, want_lp, _ = greedy_reference(logp, r.prompt, r.max_new_tokens)
        assert c.tokens.tolist() == want, r.id
        np.testing.assert_allclose(c.logprobs, want_lp, atol=1e-4)
    assert stats["placed_from_standby"] > 0 and stats["running"] == stats["standby"] == 0
    assert loop.admissions_with_rows_in_flight > 0, "no admission happened while staged rows were in flight"
    assert not loop.direct_with_rows_in_flight, "a free slot took an insert while staged rows were in flight"


def test_standby_rows_default_to_the_bucket_of_the_longest_prompt():
    from areal_jax.sampler.config import RolloutConfig, prompt_bucket

    assert [prompt_bucket(3584, n) for n in (1, 16, 17, 80, 1536, 2048, 2049)] == [16, 16, 32, 128, 2048, 2048, 3584]
    assert prompt_bucket(1500, 1200) == 1500  # the last bucket is max_len itself
    code = RolloutConfig(max_len=3584, num_slots=256)
    assert code.standby_length() == 512 and code.for_prompts(1536).standby_len == 2048  # every prompt fits a row
    assert RolloutConfig(max_len=128).for_prompts(80).standby_len == 128  # the default math job: 80 -> 128
    assert RolloutConfig(max_len=3584, standby_len=256).for_prompts(1536).standby_len == 256  # set: kept
