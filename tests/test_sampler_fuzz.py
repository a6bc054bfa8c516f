"""The SamplerLoop under random interleavings of submissions, aborts and weight updates that arrive while
dispatches are in flight, over the dense and the paged cache, with and without standby rows (on the dense cache
also rows too short for the longer prompts), and over a pool so small that optimistic admission preempts
samples. Whatever the order:

- every sample of every submitted request comes back exactly once;
- only samples of aborted requests come back "interrupted", each with a prefix of what it would have generated;
- the others end at a stop token or at their budget;
- version tags never decrease and name versions that were published;
- with recompute updates, every token's log-prob equals a full forward pass of the version it is tagged with;
- nothing is left running or staged, and a paged cache gets every page back.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_jax.sampler import Engine, Request, SamplerLoop
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import (
    collect_while_submitting,
    full_forward_logp,
    on_each_dispatch,
    submit_all,
    token_logp_errors,
)

MAX_LEN = 48
CFG = testing.tiny_config("qwen2")
VERSIONS = (3, 8)  # the versions the updates publish, in order
STOP = 17


@pytest.fixture(scope="module")
def models():
    return [testing.random_model(CFG, seed=s) for s in range(3)]  # version 0, then VERSIONS


@pytest.fixture(scope="module")
def logps(models):
    return {v: full_forward_logp(m, MAX_LEN) for v, m in zip((0, *VERSIONS), models)}


@pytest.fixture(scope="module")
def engines(models):
    m = models[0]
    return {
        "dense": Engine(m, num_slots=3, max_len=MAX_LEN),
        "dense+standby": Engine(m, num_slots=3, max_len=MAX_LEN, standby_rows=2),
        # Prompts of 9-12 tokens (bucket 16) do not fit its 8-position standby rows: they go into free slots, also
        # while dispatches carrying staged rows are in flight.
        "dense+short-standby": Engine(m, num_slots=3, max_len=MAX_LEN, standby_rows=2, standby_len=8,
                                      prefill_buckets=(8, 16, MAX_LEN)),
        "paged": PagedEngine(m, num_slots=3, max_len=MAX_LEN, page_size=4, num_pages=24),
        "paged+standby": PagedEngine(m, num_slots=3, max_len=MAX_LEN, page_size=4, num_pages=24, standby_rows=3),
        # Sequences of at most 24 positions (the longest request) in 7 pages of 4, a little more than one of them:
        # admitted optimistically, samples are preempted often.
        "paged+optimistic": PagedEngine(m, num_slots=3, max_len=24, page_size=4, num_pages=7, standby_rows=2,
                                        admission="optimistic"),
    }


request_spec = st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 3), st.booleans(), st.booleans())
event = st.tuples(st.integers(0, 8), st.sampled_from(["abort", "update", "submit"]), request_spec, st.integers(0, 9))


def make_request(rid, spec, rng):
    prompt_len, max_new, n, stop, greedy = spec
    return Request(id=rid, prompt=rng.integers(3, CFG.vocab_size, prompt_len).tolist(), max_new_tokens=max_new,
                   n=n, temperature=0.0 if greedy else 1.0, stop_token_ids=(STOP,) if stop else ())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # (CI time)
@given(kind=st.sampled_from(["dense", "dense+standby", "dense+short-standby", "paged", "paged+standby",
                             "paged+optimistic"]),
       initial=st.lists(request_spec, min_size=1, max_size=5), events=st.lists(event, max_size=6),
       k=st.integers(1, 4), fetch_behind=st.booleans(), on_update=st.sampled_from(["recompute", "continue"]),
       seed=st.integers(0, 1000))
def test_random_interleavings_keep_the_loops_promises(models, logps, engines, kind, initial, events, k, fetch_behind,
                                                      on_update, seed):
    rng = np.random.default_rng(seed)
    requests = {i: make_request(i, spec, rng) for i, spec in enumerate(initial)}
    engine = engines[kind]
    loop = SamplerLoop(engine, nnx.split(models[0])[1], decode_steps=k, fetch_behind=fetch_behind,
                       on_update=on_update, seed=seed)
    lock = threading.Lock()
    fired = {"aborted": set(), "updates": 0}

    def apply_events(n):  # events arrive while the dispatch they name is in flight
        with lock:
            for at, what, spec, target in events:
                if at != n:
                    continue
                if what == "abort":  # a request submitted so far (it may have finished already)
                    rid = list(requests)[target % len(requests)]
                    fired["aborted"].add(rid)
                    loop.abort(rid)
                elif what == "update" and fired["updates"] < len(VERSIONS):
                    loop.update_params(nnx.split(models[1 + fired["updates"]])[1], version=VERSIONS[fired["updates"]])
                    fired["updates"] += 1
                elif what == "submit":
                    rid = 100 + len(requests)
                    requests[rid] = make_request(rid, spec, rng)
                    loop.submit(requests[rid])

    def expected():
        with lock:
            return sum(r.n for r in requests.values())

    try:
        with on_each_dispatch(engine, apply_events):
            submit_all(loop, list(requests.values()))
            got = collect_while_submitting(loop, expected)
            stats = loop.stats()
    finally:
        loop.stop(graceful=False)

    published = {0, *VERSIONS[: fired["updates"]]}
    for (rid, i), c in got.items():
        r = requests[rid]
        assert 0 <= i < r.n
        assert np.all(np.diff(c.versions) >= 0) and set(c.versions.tolist()) <= published
        if c.finish_reason == "interrupted":
            assert rid in fired["aborted"] and len(c.tokens) <= r.max_new_tokens
        elif c.finish_reason == "stop":
            assert c.tokens[-1] == STOP and len(c.tokens) <= r.max_new_tokens
        else:
            assert c.finish_reason == "length" and len(c.tokens) == r.max_new_tokens
        if on_update == "recompute" or fired["updates"] == 0:  # every token exact under its version
            assert len(c.tokens) == 0 or token_logp_errors(c, logps).max() < 1e-4
        if r.temperature == 0.0 and set(c.versions.tolist()) <= {0}:  # greedy under one version: the argmax
            seq = list(r.prompt)
            for tok in c.tokens:
                assert tok == int(np.argmax(logps[0](seq)[-1]))
                seq.append(int(tok))
    assert stats["running"] == stats["standby"] == 0 and stats["queue_depth"] == 0
    if isinstance(engine, PagedEngine):
        assert engine.allocator.free_pages == engine.num_pages and not engine.allocator.refcount.any()
