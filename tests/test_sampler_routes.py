"""The experts a mixture-of-experts sampler records for routing replay (sampler.routes): each prompt position's from
its prefill, each generated token's from the decode step that fed it, over a dense or paged cache, with standby rows,
multi-step dispatches, preemption and a weight update mid-generation; checked against plain full forwards of the
model (or models) that computed them."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from areal_jax.sampler import Engine, Request, SamplerLoop
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.sampler import (
    HookAfterDispatch,
    collect_completions,
    collect_while_submitting,
    on_each_dispatch,
    run_requests,
    submit_all,
)

CFG = tiny_config("qwen3_moe", num_layers=3, moe_layers=(1, 0, 1))  # two expert layers around a dense one
MAX_LEN = 48


@pytest.fixture(scope="module")
def models():
    return random_model(CFG, seed=4), random_model(CFG, seed=5)


def full_routes(model):
    """f(seq) -> [len(seq), L_moe, k] the experts a plain forward (no cache) picks, each position's sorted (the order
    of a top k is its probabilities', which two ways of summing may swap when they are close)."""
    graphdef, params = nnx.split(model)
    fwd = jax.jit(lambda p, t: nnx.merge(graphdef, p).hidden(t, record_routes=True)[1]["routes"][0])

    def routes(seq):
        padded = np.zeros((1, MAX_LEN), np.int32)  # one program; causal attention hides the padding
        padded[0, :len(seq)] = seq
        return np.sort(np.asarray(fwd(params, jnp.asarray(padded)))[:len(seq)], -1)

    return routes


def requests():
    return [Request(id="g", prompt=[5, 9, 11, 3, 7], max_new_tokens=14, n=3, temperature=1.0),
            Request(id="a", prompt=[8, 8, 20, 31, 40, 2, 6, 9, 13], max_new_tokens=21, temperature=1.0),
            Request(id="b", prompt=[12, 4], max_new_tokens=6, temperature=0.0),
            Request(id="c", prompt=[30, 31, 32, 33], max_new_tokens=25, n=2, temperature=1.0)]


@pytest.mark.parametrize("kind,k,standby", [("dense", 1, 0), ("dense", 4, 2), ("paged", 4, 2), ("mesh", 2, 2)])
def test_recorded_routes_are_the_samplers_own(models, kind, k, standby):
    """Every finished sample's routes cover its prompt and completion and equal a full forward's: over a dense or paged
    cache (or a dense one sharded over a 2 x 2 rollout mesh), one to four steps per dispatch, with samples placed from
    standby rows inside a dispatch."""
    model = models[0]
    if kind == "paged":
        engine = PagedEngine(model, num_slots=3, max_len=MAX_LEN, page_size=4, standby_rows=standby)
    else:
        mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor")) if kind == "mesh" else None
        engine = Engine(model, num_slots=3, max_len=MAX_LEN, standby_rows=standby, mesh=mesh)
    done, stats = run_requests(engine, nnx.split(model)[1], requests(), decode_steps=k, record_routes=True)
    want = full_routes(model)
    assert len(done) == 7 and (stats["placed_from_standby"] > 0) == bool(standby)
    for c in done:
        seq = [*c.prompt, *c.tokens.tolist()]
        assert c.finish_reason in ("stop", "length") and c.routes.shape == (len(seq), 2, 2)
        assert c.routes.dtype == np.uint8  # 4 experts: expert ids in one byte (moe.routes_dtype)
        np.testing.assert_array_equal(np.sort(c.routes, -1), want(seq))
    plain, _ = run_requests(engine, nnx.split(model)[1], requests(), decode_steps=k)
    assert all(c.routes is None for c in plain)
    for a, b in zip(plain, done):  # recording changes no token
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_routes_survive_preemption(models):
    """Over a small pool admitted optimistically, samples give their pages back and resume by recompute; their routes
    still cover every token and equal a full forward's (the resume's prefill does not replace them)."""
    model = models[0]
    engine = PagedEngine(model, num_slots=4, max_len=MAX_LEN, page_size=4, num_pages=16, admission="optimistic")
    reqs = [Request(id=i, prompt=[4 + i, 9, 12], max_new_tokens=n, temperature=1.0)
            for i, n in enumerate([30, 33, 28, 35, 31, 29])]
    done, stats = run_requests(engine, nnx.split(model)[1], reqs, decode_steps=3, record_routes=True)
    assert stats["preempted"] > 0
    want = full_routes(model)
    for c in done:
        np.testing.assert_array_equal(np.sort(c.routes, -1), want([*c.prompt, *c.tokens.tolist()]))


def test_routes_across_a_weight_update_are_those_of_the_params_that_fed_each_token(models):
    """A recompute update after the second dispatch: the prompt's routes are the old model's (its prefill drew the
    first token), and a generated token's those of the params that sampled it (its version tag): the decode step that
    samples a token feeds it, and the recompute's prefill replaces none of them."""
    old, new = models
    engine = HookAfterDispatch(old, num_slots=4, max_len=MAX_LEN)
    loop = SamplerLoop(engine, nnx.split(old)[1], decode_steps=3, seed=3, record_routes=True)
    engine.hook = lambda: loop.update_params(nnx.split(new)[1], version=7)
    loop.pause()
    loop.submit(Request(id="g", prompt=[5, 17, 23, 42], max_new_tokens=18, n=2))
    loop.submit(Request(id="s", prompt=[6, 17, 23], max_new_tokens=18))
    loop.resume()
    done = collect_completions(loop, 3)
    loop.stop()
    by_version = {0: full_routes(old), 7: full_routes(new)}
    for c in done:
        seq = [*c.prompt, *c.tokens.tolist()]
        assert set(c.versions.tolist()) == {0, 7}
        np.testing.assert_array_equal(np.sort(c.routes[:len(c.prompt)], -1), by_version[0](seq)[:len(c.prompt)])
        for j, version in enumerate(c.versions.tolist()):
            p = len(c.prompt) + j
            np.testing.assert_array_equal(np.sort(c.routes[p], -1), by_version[version](seq)[p])
        late = c.versions == 7
        old_picks = np.sort(c.routes[len(c.prompt):][late], -1) == by_version[0](seq)[len(c.prompt):][late]
        assert not old_picks.all(), "the new params route some token differently (else this test shows nothing)"


def test_routes_are_kept_in_the_smallest_integer_type():
    from areal_jax.sampler.routes import routes_dtype

    assert [routes_dtype(e) for e in (1, 8, 256, 257, 32768, 32769)] == [np.uint8] * 3 + [np.int16] * 2 + [np.int32]


def test_routes_need_a_mixture_of_experts_model():
    dense = random_model(tiny_config("qwen3"), seed=0)
    engine = Engine(dense, num_slots=2, max_len=16)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        engine.prefill_many(nnx.split(dense)[1], [[1, 2, 3]], routes=True)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        SamplerLoop(engine, nnx.split(dense)[1], record_routes=True)


# ---- random interleavings: every finished sample's routes are those of the versions its tokens are tagged with ----
VERSIONS = (3, 8)
STOP = 17


@pytest.fixture(scope="module")
def fuzz_models():
    return [random_model(CFG, seed=s) for s in (4, 5, 6)]  # version 0, then VERSIONS


@pytest.fixture(scope="module")
def fuzz_engines(fuzz_models):
    m = fuzz_models[0]
    return {"dense": Engine(m, num_slots=3, max_len=MAX_LEN),
            "dense+standby": Engine(m, num_slots=3, max_len=MAX_LEN, standby_rows=2),
            "paged+standby": PagedEngine(m, num_slots=3, max_len=MAX_LEN, page_size=4, num_pages=24, standby_rows=3),
            "paged+optimistic": PagedEngine(m, num_slots=3, max_len=24, page_size=4, num_pages=7, standby_rows=2,
                                            admission="optimistic")}


request_spec = st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 3), st.booleans())
event = st.tuples(st.integers(0, 8), st.sampled_from(["abort", "update", "submit"]), request_spec, st.integers(0, 9))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # (CI time)
@given(kind=st.sampled_from(["dense", "dense+standby", "paged+standby", "paged+optimistic"]),
       initial=st.lists(request_spec, min_size=1, max_size=4), events=st.lists(event, max_size=5),
       k=st.integers(1, 4), fetch_behind=st.booleans(), seed=st.integers(0, 1000))
def test_random_interleavings_record_each_tokens_own_routes(fuzz_models, fuzz_engines, kind, initial, events, k,
                                                            fetch_behind, seed):
    """Submissions, aborts and recompute updates arriving while dispatches are in flight, over dense and paged caches,
    standby rows and preemption: every finished sample carries routes for its prompt and every token, the prompt's
    those of the version of its first token (the prefill that drew it) and each token's those of its own version; an
    interrupted one carries none. (At most 1% of positions may differ from the full forward: the cached decode sums
    in another order, which can flip a near tie.)"""
    rng = np.random.default_rng(seed)

    def make(rid, spec):
        prompt_len, max_new, n, stop = spec
        return Request(id=rid, prompt=rng.integers(3, CFG.vocab_size, prompt_len).tolist(), max_new_tokens=max_new,
                       n=n, temperature=1.0, stop_token_ids=(STOP,) if stop else ())

    requests = {i: make(i, spec) for i, spec in enumerate(initial)}
    engine = fuzz_engines[kind]
    loop = SamplerLoop(engine, nnx.split(fuzz_models[0])[1], decode_steps=k, fetch_behind=fetch_behind, seed=seed,
                       record_routes=True)
    lock, fired = threading.Lock(), {"updates": 0}

    def apply_events(n):
        with lock:
            for at, what, spec, target in events:
                if at != n:
                    continue
                if what == "abort":
                    loop.abort(list(requests)[target % len(requests)])
                elif what == "update" and fired["updates"] < len(VERSIONS):
                    loop.update_params(nnx.split(fuzz_models[1 + fired["updates"]])[1],
                                       version=VERSIONS[fired["updates"]])
                    fired["updates"] += 1
                elif what == "submit":
                    rid = 100 + len(requests)
                    requests[rid] = make(rid, spec)
                    loop.submit(requests[rid])

    def expected():
        with lock:
            return sum(r.n for r in requests.values())

    try:
        with on_each_dispatch(engine, apply_events):
            submit_all(loop, list(requests.values()))
            got = list(collect_while_submitting(loop, expected).values())
    finally:
        loop.stop(graceful=False)
    forwards = dict(zip((0, *VERSIONS), (full_routes(m) for m in fuzz_models)))
    differ = total = 0
    for c in got:
        if c.finish_reason == "interrupted":
            assert c.routes is None
            continue
        seq, p = [*c.prompt, *c.tokens.tolist()], len(c.prompt)
        assert c.routes.shape == (len(seq), 2, 2)
        picks = np.sort(c.routes, -1)
        want = np.concatenate([forwards[int(c.versions[0])](seq)[:p]] +
                              [forwards[int(v)](seq)[p + j][None] for j, v in enumerate(c.versions.tolist())])
        differ += int(np.any(picks != want, axis=(1, 2)).sum())
        total += len(seq)
    assert differ <= 0.01 * total, f"{differ} of {total} positions routed unlike their version's full forward"
