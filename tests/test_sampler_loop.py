"""SamplerLoop behaviour: interruptible weight updates, versions, errors, pause / resume / stop / abort."""
from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.sampler import Engine, Request, SamplerLoop, SamplerLoopError, SamplingParams
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import collect_completions, full_forward_logp, token_logp_errors, wait_until

MAX_LEN = 64
CFG = testing.tiny_config("qwen3")


@pytest.fixture(scope="module")
def models():
    return testing.random_model(CFG, seed=0), testing.random_model(CFG, seed=1)


def run_with_update(models, on_update):
    old, new = models
    engine = Engine(old, num_slots=4, max_len=MAX_LEN)
    loop = SamplerLoop(engine, nnx.split(old)[1], on_update=on_update, seed=3)
    loop.pause()
    for i in range(3):
        loop.submit(Request(id=i, prompt=[5 + i, 17, 23, 42 + i], max_new_tokens=24, n=2 if i == 0 else 1))
    loop.resume()
    wait_until(lambda: loop.stats()["steps"] >= 3)
    loop.pause()
    loop.update_params(nnx.split(new)[1], version=7)
    assert loop.current_version == 0, "the update lands at the next step boundary, not while paused"
    loop.resume()
    done = collect_completions(loop, 4)
    stats = loop.stats()
    loop.stop()
    assert loop.current_version == 7 and stats["updates"] == 1
    return done, stats


def test_recompute_makes_later_tokens_follow_the_new_params(models):
    done, stats = run_with_update(models, "recompute")
    logps = {0: full_forward_logp(models[0], MAX_LEN), 7: full_forward_logp(models[1], MAX_LEN)}
    mixed = 0
    for c in done:
        assert set(np.unique(c.versions)) <= {0, 7}
        assert (np.diff(c.versions) >= 0).all(), "versions only move forward within a sequence"
        mixed += len(set(c.versions.tolist())) == 2
        assert token_logp_errors(c, logps).max() < 1e-4
    assert mixed >= 1 and stats["recomputes"] >= mixed


def test_continue_keeps_the_stale_cache(models):
    done, stats = run_with_update(models, "continue")
    logps = {0: full_forward_logp(models[0], MAX_LEN), 7: full_forward_logp(models[1], MAX_LEN)}
    assert stats["recomputes"] == 0
    later = []
    for c in done:
        errs = token_logp_errors(c, logps)
        old = c.versions == 0
        # Tokens sampled from logits computed before the update are exact under the old params...
        assert errs[old].max() < 1e-4
        later.extend(errs[~old].tolist())
    # ...but the new params reading a cache written by the old ones are not a full forward of either.
    assert later and max(later) > 1e-3


@pytest.mark.parametrize("on_update", ["recompute", "continue"])
def test_prefixes_queued_across_an_update(models, on_update):
    """Prompts prefilled ahead of their slot and still queued when new params arrive (three slots, two held by a
    long request; one call prefills the next three prompts and one of them takes the free slot): recompute
    prefills the two still queued again under the new params; continue keeps their prefixes, as it keeps a
    running sample's cache, and tags each one's first token with the old version. Reference for continue: the
    same engine driven by hand, the prompt prefilled with the old params and every step decoded with the new."""
    old, new = models
    engine = Engine(old, num_slots=3, max_len=MAX_LEN, prefill_batch=3)
    calls = []
    prefill_many = engine.prefill_many
    engine.prefill_many = lambda params, prompts, **kw: calls.append([tuple(p) for p in prompts]) or prefill_many(
        params, prompts, **kw)
    queued = {"c": [6, 17, 23, 43], "d": [7, 17, 23, 44]}
    loop = SamplerLoop(engine, nnx.split(old)[1], on_update=on_update, seed=3)
    loop.submit(Request(id="a", prompt=[5, 17, 23, 42], max_new_tokens=40, n=2, temperature=0.0))
    wait_until(lambda: loop.stats()["steps"] >= 1)
    loop.pause()
    loop.submit(Request(id="b", prompt=[8, 17, 23, 45], max_new_tokens=40, temperature=0.0))
    for rid, prompt in queued.items():
        loop.submit(Request(id=rid, prompt=prompt, max_new_tokens=6, temperature=0.0))
    steps = loop.stats()["steps"]
    loop.resume()
    wait_until(lambda: loop.stats()["steps"] > steps)
    loop.pause()  # "b" runs beside "a"; "c" and "d" wait with prefixes of version 0
    assert [tuple(p) for p in queued.values()] == calls[-1][1:]
    loop.update_params(nnx.split(new)[1], version=7)
    loop.resume()
    done = {c.request_id: c for c in collect_completions(loop, 5)}
    loop.stop()
    prefilled = [row for call in calls for row in call]
    for rid, prompt in queued.items():
        assert prefilled.count(tuple(prompt)) == (2 if on_update == "recompute" else 1), rid
        if on_update == "recompute":
            assert (done[rid].versions == 7).all()
    if on_update == "recompute":
        return
    _, old_params = nnx.split(old)
    _, new_params = nnx.split(new)
    for rid, prompt in queued.items():
        c = done[rid]
        assert c.versions[0] == 0 and (c.versions[1:] == 7).all()
        ref = Engine(old, num_slots=1, max_len=MAX_LEN)
        state = ref.insert(ref.prefill(old_params, prompt), ref.init_decode_state(), 0,
                           SamplingParams(temperature=0.0, max_new_tokens=6))
        tokens, logprobs = [], []
        for _ in range(6):
            state, r = ref.generate(new_params, state, jax.random.key(0))
            r = r.to_host()
            tokens.append(int(r.tokens[0]))
            logprobs.append(float(r.logprobs[0]))
        assert c.tokens.tolist() == tokens
        np.testing.assert_allclose(c.logprobs, logprobs, atol=1e-5)


def test_group_samples_share_a_prefill_and_overflow_the_slots(models):
    engine = Engine(models[0], num_slots=3, max_len=MAX_LEN)
    logp = full_forward_logp(models[0], MAX_LEN)
    with SamplerLoop(engine, nnx.split(models[0])[1], seed=0) as loop:
        loop.submit(Request(id="g", prompt=[8, 9, 10], max_new_tokens=6, n=5, top_k=5, top_p=0.9))
        assert loop.num_pending() == 5
        done = collect_completions(loop, 5)
        assert loop.num_pending() == 0
    assert sorted(c.sample_index for c in done) == [0, 1, 2, 3, 4]
    for c in done:
        seq = list(c.prompt)
        for tok in c.tokens:
            order = np.argsort(-logp(seq)[-1], kind="stable")
            assert tok in order[:5], "top-k 5 emitted a token outside the 5 most likely"
            seq.append(int(tok))


def test_queued_prompts_are_prefilled_together_once_each(models):
    """Admission prefills the queue head's prompts in batched calls, one row per distinct prompt: a greedy
    and a sampled request of the same prompt share it, and prompts queued behind full slots are prefilled
    ahead. The greedy sequences still equal greedy decoding by full forwards."""
    engine = Engine(models[0], num_slots=6, max_len=MAX_LEN, prefill_batch=4)
    calls = []
    prefill_many = engine.prefill_many
    engine.prefill_many = lambda params, prompts, **kw: calls.append([tuple(p) for p in prompts]) or prefill_many(
        params, prompts, **kw)
    logp = full_forward_logp(models[0], MAX_LEN)
    prompts = [[8 + i, 9, 10 + 2 * i] + [11] * i for i in range(5)]
    with SamplerLoop(engine, nnx.split(models[0])[1], seed=0) as loop:
        loop.pause()
        for i, prompt in enumerate(prompts):
            loop.submit(Request(id=("greedy", i), prompt=prompt, max_new_tokens=5, n=1, temperature=0.0))
            loop.submit(Request(id=("sampled", i), prompt=prompt, max_new_tokens=5, n=3, temperature=1.0))
        loop.resume()
        done = collect_completions(loop, 5 * 4)
    rows = [row for call in calls for row in call]
    assert sorted(rows) == sorted(tuple(p) for p in prompts), "each distinct prompt is prefilled exactly once"
    assert [len(call) for call in calls] == [4, 1], "the first call fills its rows past the 6 free slots"
    for c in done:
        if c.request_id[0] == "greedy":
            seq = list(c.prompt)
            for tok in c.tokens:
                assert tok == int(np.argmax(logp(seq)[-1]))
                seq.append(int(tok))


def test_too_long_prompt_is_an_error_for_that_request_only(models):
    engine = Engine(models[0], num_slots=2, max_len=32)
    with SamplerLoop(engine, nnx.split(models[0])[1]) as loop:
        loop.submit(Request(id="long", prompt=list(range(4, 44)), max_new_tokens=4, n=2))
        loop.submit(Request(id="clamped", prompt=list(range(4, 28)), max_new_tokens=50, temperature=0.0))
        loop.submit(Request(id="ok", prompt=[4, 5], max_new_tokens=3, temperature=0.0))
        done = {(c.request_id, c.sample_index): c for c in collect_completions(loop, 4)}
    for i in range(2):
        bad = done[("long", i)]
        assert bad.finish_reason == "error" and "40 tokens" in bad.error and "max_len" in bad.error
        assert bad.tokens.size == 0
    clamped = done[("clamped", 0)]
    assert clamped.finish_reason == "length" and len(clamped.tokens) == 32 - 24
    assert done[("ok", 0)].finish_reason == "length" and len(done[("ok", 0)].tokens) == 3


def test_params_of_another_shape_are_refused_at_once(models):
    engine = Engine(models[0], num_slots=2, max_len=32)
    with SamplerLoop(engine, nnx.split(models[0])[1]) as loop:
        wrong = testing.random_model(testing.tiny_config("qwen3", hidden_size=32), seed=0)
        with pytest.raises(ValueError, match="same model configuration"):
            loop.update_params(nnx.split(wrong)[1], version=1)
        deeper = testing.random_model(testing.tiny_config("qwen3", num_layers=3), seed=0)
        with pytest.raises(ValueError, match="tree structure"):
            loop.update_params(nnx.split(deeper)[1], version=1)


def test_errors_inside_the_thread_reach_the_caller(models):
    engine = Engine(models[0], num_slots=2, max_len=32)

    def broken_step(params, state, rng, **kwargs):
        raise RuntimeError("device lost")

    engine.generate_steps = broken_step
    loop = SamplerLoop(engine, nnx.split(models[0])[1])
    loop.submit(Request(id=0, prompt=[4, 5, 6], max_new_tokens=3))
    with pytest.raises(SamplerLoopError, match="device lost"):
        loop.get_completion(timeout=60)
    with pytest.raises(SamplerLoopError):
        loop.submit(Request(id=1, prompt=[4], max_new_tokens=1))
    with pytest.raises(SamplerLoopError):
        loop.stop()


def test_pause_resume_stop_and_abort(models):
    engine = Engine(models[0], num_slots=2, max_len=MAX_LEN)
    loop = SamplerLoop(engine, nnx.split(models[0])[1])
    loop.submit(Request(id="a", prompt=[4, 5], max_new_tokens=60))
    loop.submit(Request(id="b", prompt=[6, 7], max_new_tokens=60))
    loop.submit(Request(id="queued", prompt=[6, 7], max_new_tokens=40, n=2))
    wait_until(lambda: loop.stats()["steps"] >= 2)
    loop.pause()
    steps = loop.stats()["steps"]
    time.sleep(0.1)
    assert loop.stats()["steps"] == steps, "a paused loop must not step"
    loop.abort("a")
    loop.resume()
    aborted = loop.get_completion(timeout=30)
    assert aborted.request_id == "a" and aborted.finish_reason == "interrupted"
    assert 2 <= len(aborted.tokens) < 60 and len(aborted.logprobs) == len(aborted.tokens)
    wait_until(lambda: loop.stats()["running"] == 2)  # the queued group took the freed slot
    # ... and decoded: a dispatch issued after its admission has been fetched. At most one dispatch (one
    # token, b's) was in flight when it was admitted, so three more tokens mean a later one came back.
    generated = loop.stats()["generated_tokens"]
    wait_until(lambda: loop.stats()["generated_tokens"] >= generated + 3)
    loop.stop(graceful=False)
    rest = collect_completions(loop, 3)
    assert {c.finish_reason for c in rest} == {"interrupted"}
    assert sorted(len(c.tokens) > 0 for c in rest) == [False, True, True], "one group sample never started"
    assert any(c.request_id == "b" and c.finish_reason == "interrupted" for c in rest)
    assert loop.get_completion(timeout=1) is None
    with pytest.raises(RuntimeError, match="after stop"):
        loop.submit(Request(id="late", prompt=[4], max_new_tokens=1))


def test_graceful_stop_finishes_everything_submitted(models):
    engine = Engine(models[0], num_slots=2, max_len=MAX_LEN)
    loop = SamplerLoop(engine, nnx.split(models[0])[1])
    for i in range(5):
        loop.submit(Request(id=i, prompt=[4 + i], max_new_tokens=5, temperature=0.0))
    loop.stop(graceful=True)
    done = collect_completions(loop, 5, timeout=1)
    assert all(c.finish_reason == "length" and len(c.tokens) == 5 for c in done)
    assert loop.num_pending() == 0
