"""Optimistic admission over a paged cache: more sequences share a pool than worst-case reservations allow, and
when the pool runs short running samples give their pages back and resume by recompute, with exact tokens."""
from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from areal_jax.config import from_config_dict
from areal_jax.knobs import ConfigError
from areal_jax.sampler import Engine, Request, SamplerLoop
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import collect_completions, full_forward_logp, run_requests, token_logp_errors

MAX_LEN = 48
CFG = testing.tiny_config("qwen2")


@pytest.fixture(scope="module")
def models():
    return testing.random_model(CFG, seed=0), testing.random_model(CFG, seed=1)


def requests_with_a_long_tail():
    # Budgets long-tailed like RL generations: most short, a few near max_len.
    budgets = [36, 4, 6, 30, 3, 5, 8, 34, 4, 7]
    reqs = [Request(id=i, prompt=[5 + i, 9, 11 + i, 13], max_new_tokens=b, temperature=0.0)
            for i, b in enumerate(budgets)]
    reqs.append(Request(id="g", prompt=[7, 8, 9, 10, 11, 12], max_new_tokens=20, n=3, temperature=0.0))
    return reqs


@pytest.mark.parametrize("standby_rows", [0, 2])
def test_optimistic_admission_runs_more_sequences_with_the_same_tokens(models, standby_rows):
    params = nnx.split(models[0])[1]
    requests = requests_with_a_long_tail()
    dense, _ = run_requests(Engine(models[0], num_slots=4, max_len=MAX_LEN), params, requests, decode_steps=3)
    engines = {mode: PagedEngine(models[0], num_slots=4, max_len=MAX_LEN, page_size=4, num_pages=16, admission=mode,
                                 standby_rows=standby_rows) for mode in ("reserve", "optimistic")}
    # 16 pages of 4 positions hold one sequence of 40 at its longest: reservations run about one at a time.
    runs = {mode: run_requests(e, params, requests, decode_steps=3) for mode, e in engines.items()}
    logp = full_forward_logp(models[0], MAX_LEN)
    for mode, (done, stats) in runs.items():
        for a, b in zip(dense, done):
            assert (a.request_id, a.sample_index, a.finish_reason) == (b.request_id, b.sample_index, b.finish_reason)
            np.testing.assert_array_equal(a.tokens, b.tokens)
            assert token_logp_errors(b, {0: logp}).max() < 1e-4
        engine = engines[mode]
        assert engine.allocator.free_pages == 16 and not engine.allocator.refcount.any()
    assert runs["reserve"][1]["preempted"] == 0 and runs["optimistic"][1]["preempted"] > 0
    assert engines["optimistic"].peak_active > engines["reserve"].peak_active
    assert runs["optimistic"][1]["mean_slot_occupancy"] > runs["reserve"][1]["mean_slot_occupancy"]


def test_a_recompute_update_and_aborts_with_preempted_samples(models):
    old, new = models
    engine = PagedEngine(old, num_slots=4, max_len=MAX_LEN, page_size=4, num_pages=16, admission="optimistic")
    loop = SamplerLoop(engine, nnx.split(old)[1], decode_steps=3, seed=1)
    requests = [Request(id=i, prompt=[4 + i, 9, 12], max_new_tokens=n) for i, n in enumerate([30, 33, 28, 35, 31, 29])]
    loop.pause()
    for r in requests:
        loop.submit(r)
    loop.resume()
    first = collect_completions(loop, 1)
    loop.update_params(nnx.split(new)[1], version=4)
    loop.abort(5)
    done = first + collect_completions(loop, len(requests) - 1)
    stats = loop.stats()
    loop.stop()
    assert stats["preempted"] > 0 and stats["updates"] == 1
    logps = {0: full_forward_logp(old, MAX_LEN), 4: full_forward_logp(new, MAX_LEN)}
    for c in done:
        assert np.all(np.diff(c.versions) >= 0) and set(c.versions.tolist()) <= {0, 4}
        assert len(c.tokens) == 0 or token_logp_errors(c, logps).max() < 1e-4  # exact under each token's version
        if c.finish_reason == "interrupted":
            assert c.request_id == 5
        else:
            assert c.finish_reason == "length" and len(c.tokens) == requests[c.request_id].max_new_tokens
    assert engine.allocator.free_pages == 16 and not engine.allocator.refcount.any()


def test_admission_is_checked(models):
    with pytest.raises(ValueError, match='admission must be "reserve" or "optimistic"'):
        PagedEngine(models[0], num_slots=2, max_len=MAX_LEN, admission="greedy")
    with pytest.raises(ConfigError, match="kv_admission=optimistic needs"):
        from_config_dict({"rollout": {"kv_admission": "optimistic"}})
    cfg = from_config_dict({"rollout": {"kv_admission": "optimistic", "kv_cache": "paged"}})
    assert cfg.rollout.kv_admission == "optimistic"
