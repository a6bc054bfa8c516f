"""Multi-step decode: k steps per dispatch equal k single steps; updates, stops and admissions between dispatches."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax import config as config_lib
from areal_jax.sampler import Engine, Request, SamplerLoop, SamplingParams
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import HookAfterDispatch, collect_completions, full_forward_logp, run_requests

MAX_LEN = 64
CFG = testing.tiny_config("qwen3")


@pytest.fixture(scope="module")
def models():
    return testing.random_model(CFG, seed=0), testing.random_model(CFG, seed=1)


def keys(n, seed=0):
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)))


def armed_state(engine, params):
    """Three sampled slots with different settings: one with a stop token, one with a tiny budget."""
    state = engine.init_decode_state()
    requests = [([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=9)),
                ([9, 10], SamplingParams(temperature=0.7, top_k=5, max_new_tokens=3)),
                ([11, 12, 13, 14], SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12,
                                                  stop_token_ids=(3, 40, 41, 42)))]
    return engine.insert_sequences(params, state, [0, 1, 2], [p for p, _ in requests], [s for _, s in requests])


def test_k_steps_in_one_dispatch_equal_k_single_steps(models):
    engine = Engine(models[0], num_slots=4, max_len=MAX_LEN)
    _, params = nnx.split(models[0])
    ks = keys(12)
    single = armed_state(engine, params)
    steps = []
    for t in range(12):
        single, r = engine.generate(params, single, ks[t])
        steps.append(r.to_host())
    multi, got = armed_state(engine, params), []
    for start in (0, 5, 10):  # dispatches of 5, 5 and 2 steps
        n = min(5, 12 - start)
        multi, r = engine.generate_steps(params, multi, ks[start : start + n])
        got.append(r.to_host())
    tokens = np.concatenate([r.tokens for r in got])
    logprobs = np.concatenate([r.logprobs for r in got])
    valid = np.concatenate([r.valid for r in got])
    want_valid = np.stack([s.valid for s in steps])
    np.testing.assert_array_equal(valid, want_valid)
    np.testing.assert_array_equal(np.where(valid, tokens, -1), np.where(want_valid, np.stack([s.tokens for s in steps]), -1))
    np.testing.assert_allclose(logprobs[valid], np.stack([s.logprobs for s in steps])[want_valid], atol=1e-5)
    np.testing.assert_array_equal(got[-1].done, steps[-1].done)
    np.testing.assert_allclose(np.stack(multi.cache.k), np.stack(single.cache.k), atol=1e-5)
    # Each slot's valid steps are a prefix; slot 1 (budget 3) stops inside the first dispatch and slot 3 never ran.
    assert valid[:, 1].tolist() == [True] * 3 + [False] * 9 and not valid[:, 3].any()


def test_steps_counts_the_steps_in_which_a_slot_decoded(models):
    engine = Engine(models[0], num_slots=2, max_len=MAX_LEN)
    _, params = nnx.split(models[0])
    state = engine.insert_sequences(params, engine.init_decode_state(), [0], [[4, 5]],
                                    [SamplingParams(temperature=0.0, max_new_tokens=3)])
    state, r = engine.generate_steps(params, state, keys(8))
    r = r.to_host()
    assert int(r.steps) == 3 and r.valid[:, 0].tolist() == [True] * 3 + [False] * 5 and r.done.all()


def run_loop(model, requests, decode_steps, fetch_behind=True, num_slots=3, seed=0, counted_loop=False):
    engine = Engine(model, num_slots=num_slots, max_len=MAX_LEN, counted_loop=counted_loop)
    return run_requests(engine, nnx.split(model)[1], requests, seed=seed, decode_steps=decode_steps,
                        fetch_behind=fetch_behind)


@pytest.mark.parametrize("decode_steps, fetch_behind, counted", [(4, True, False), (3, False, False), (4, True, True)])
def test_loop_with_multi_step_dispatches_gives_the_single_step_tokens(models, decode_steps, fetch_behind, counted):
    """More requests than slots, lengths not multiples of k: admissions reuse slots freed inside dispatches. Counted
    (the GPU's dispatch: always k trips) or ending once every slot is done, the tokens are the same."""
    requests = [Request(id=i, prompt=[4 + i, 20, 30 + i], max_new_tokens=n, temperature=0.0)
                for i, n in enumerate([5, 11, 2, 7, 9, 4, 13])]
    requests.append(Request(id="g", prompt=[7, 8, 9], max_new_tokens=6, n=2, temperature=0.0))
    base, base_stats = run_loop(models[0], requests, decode_steps=1, fetch_behind=False)
    multi, stats = run_loop(models[0], requests, decode_steps=decode_steps, fetch_behind=fetch_behind,
                            counted_loop=counted)
    logp = full_forward_logp(models[0], MAX_LEN)
    for a, b in zip(base, multi):
        assert (a.request_id, a.sample_index) == (b.request_id, b.sample_index)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert b.finish_reason == "length" and (b.versions == 0).all()
        want = [logp(list(b.prompt) + b.tokens[:i].tolist())[-1].max() for i in range(len(b.tokens))]
        np.testing.assert_allclose(b.logprobs, want, atol=1e-4)  # greedy: the top log-prob of a full forward
    assert stats["generated_tokens"] == base_stats["generated_tokens"] == sum(len(c.tokens) for c in multi)
    assert stats["dispatches"] < base_stats["dispatches"]


def test_stop_token_inside_a_dispatch_ends_the_sequence_there(models):
    prompt, k = [12, 13, 14], 4
    (free,), _ = run_loop(models[0], [Request(id=0, prompt=prompt, max_new_tokens=20, temperature=0.0)], 1)
    seq = free.tokens.tolist()
    # the first position p (not the last step of a dispatch) whose token has not appeared before
    p = next(i for i in range(1, len(seq)) if i % k != k - 1 and seq[i] not in seq[:i])
    (stopped,), _ = run_loop(models[0], [Request(id=0, prompt=prompt, max_new_tokens=20, temperature=0.0,
                                                 stop_token_ids=(seq[p],))], k)
    assert stopped.finish_reason == "stop" and stopped.tokens.tolist() == seq[: p + 1]


@pytest.mark.parametrize("on_update", ["recompute", "continue"])
@pytest.mark.parametrize("fetch_behind", [True, False])
def test_update_arriving_mid_dispatch_applies_before_the_next_dispatch(models, on_update, fetch_behind):
    old, new = models
    k = 4
    engine = HookAfterDispatch(old, num_slots=4, max_len=MAX_LEN)
    loop = SamplerLoop(engine, nnx.split(old)[1], on_update=on_update, seed=3, decode_steps=k,
                       fetch_behind=fetch_behind)
    engine.hook = lambda: loop.update_params(nnx.split(new)[1], version=7)
    loop.pause()
    loop.submit(Request(id="g", prompt=[5, 17, 23, 42], max_new_tokens=18, n=2))
    loop.submit(Request(id="s", prompt=[6, 17, 23], max_new_tokens=18))
    loop.resume()
    done = collect_completions(loop, 3)
    stats = loop.stats()
    loop.stop()
    assert stats["updates"] == 1 and loop.current_version == 7
    assert 0 <= stats["update_latency_s"] <= stats["update_latency_max_s"]
    # Dispatches 0 and 1 ran with version 0; the update is in place for dispatch 2. Recompute re-prefills, so
    # dispatch 2's first token already comes from the new params; continue samples it from the old logits.
    old_tokens = 2 * k if on_update == "recompute" else 2 * k + 1
    logps = {0: full_forward_logp(old, MAX_LEN), 7: full_forward_logp(new, MAX_LEN)}
    for c in done:
        assert c.versions.tolist() == [0] * old_tokens + [7] * (18 - old_tokens)
        seq, errs = list(c.prompt), []
        for tok, lp, ver in zip(c.tokens, c.logprobs, c.versions):
            errs.append(abs(logps[int(ver)](seq)[-1][tok] - lp))
            seq.append(int(tok))
        errs = np.array(errs)
        if on_update == "recompute":
            assert errs.max() < 1e-4, "every token is exact under the version it is tagged with"
        else:
            assert errs[:old_tokens].max() < 1e-4 and errs[old_tokens:].max() > 1e-3  # stale cache after


def test_decode_steps_is_validated(models):
    engine = Engine(models[0], num_slots=1, max_len=MAX_LEN)
    with pytest.raises(ValueError, match="decode_steps must be at least 1"):
        SamplerLoop(engine, nnx.split(models[0])[1], decode_steps=0)
    c = config_lib.base_config()
    c.rollout.decode_steps = 0
    with pytest.raises(config_lib.ConfigError, match=r"--config.rollout.decode_steps=0 must be at least 1"):
        config_lib.validate(c, check_paths=False)
