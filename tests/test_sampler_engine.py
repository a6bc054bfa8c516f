"""Engine + continuous batching against greedy decoding by repeated full forward passes (no cache)."""
from __future__ import annotations

import random
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.sampler import Engine, Request, SamplerLoop, SamplingParams, generate_batch
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import full_forward_logp, greedy_reference

MAX_LEN = 48


@pytest.fixture(scope="module")
def model():
    return testing.random_model(testing.tiny_config("qwen2"), seed=0)


def assert_greedy_matches(got_tokens, got_logprobs, want_tokens, want_logprobs, tables, tie_tol=1e-4):
    """Tokens must agree; a divergence is allowed only at a near-tie of the reference logits."""
    for i, (g, w) in enumerate(zip(got_tokens, want_tokens)):
        if g != w:
            gap = abs(tables[i][w] - tables[i][g])
            assert gap < tie_tol, f"token {i}: got {g}, reference {w}, logit gap {gap:.2e} is no tie"
            return
        assert abs(got_logprobs[i] - want_logprobs[i]) < 1e-4, f"logprob {i}"
    assert len(got_tokens) == len(want_tokens)


def test_insert_and_generate_equal_full_forward(model):
    engine = Engine(model, num_slots=3, max_len=MAX_LEN)
    _, params = nnx.split(model)
    logp = full_forward_logp(model, MAX_LEN)
    prompts = {0: [5, 6, 7], 2: list(range(20, 37))}
    state = engine.init_decode_state()
    for slot, prompt in prompts.items():
        prefix = engine.prefill(params, prompt)
        np.testing.assert_allclose(np.asarray(prefix.logprobs), logp(prompt)[-1], atol=1e-4)
        state = engine.insert(prefix, state, slot, SamplingParams(temperature=0.0, max_new_tokens=6))
    seqs = {s: list(p) for s, p in prompts.items()}
    for step in range(6):
        state, result = engine.generate(params, state, jax.random.key(step))
        r = result.to_host()
        assert not r.valid[1], "slot 1 was never filled and must stay free"
        for slot, seq in seqs.items():
            want = logp(seq)[-1]
            assert r.tokens[slot] == int(np.argmax(want))
            assert abs(r.logprobs[slot] - want[r.tokens[slot]]) < 1e-4
            seq.append(int(r.tokens[slot]))
        assert bool(r.done[0]) == bool(r.done[2]) == (step == 5)
    assert engine.compile_count <= 6


def test_prefill_many_equals_prefill_one_by_one(model):
    """Batched prefills (full calls of prefill_batch rows, one-row calls, rows of different buckets) give
    each prompt the prefix a lone prefill gives it: same logits, length, last token, cache rows, and cache
    length (its own bucket, also when batched with a longer prompt: a 3-token prompt still fits a standby row
    of 16 positions)."""
    engine = Engine(model, num_slots=4, max_len=MAX_LEN, prefill_batch=4)
    _, params = nnx.split(model)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, 60, n)) for n in (3, 17, 5, 9, 30, 1)]  # 4 + 2 rows; buckets 16 and 32
    # all six; a lone prompt of a new bucket (one row); a lone prompt of a bucket whose full-width program exists;
    # then all six again with at most 48 padded tokens per call (3 rows of bucket 16, 1 of bucket 32)
    tight = Engine(model, num_slots=4, max_len=MAX_LEN, prefill_batch=4, prefill_tokens=48)
    for engine_, batch in ((engine, prompts), (engine, prompts[:1]), (engine, prompts[1:2]), (tight, prompts)):
        got = engine_.prefill_many(params, batch)
        assert len(got) == len(batch)
        for prompt, prefix in zip(batch, got):
            want = engine.prefill(params, prompt)
            n = len(prompt)
            assert int(prefix.true_length) == n and int(prefix.last_token) == prompt[-1]
            np.testing.assert_allclose(np.asarray(prefix.logprobs), np.asarray(want.logprobs), atol=1e-5)
            for a, b in zip((*prefix.cache.k, *prefix.cache.v), (*want.cache.k, *want.cache.v)):
                assert a.shape == b.shape == (1, engine.bucket_for(n), *a.shape[2:])
                np.testing.assert_allclose(np.asarray(a)[:, :n], np.asarray(b)[:, :n], atol=1e-5)
    assert tight._prefill_many_shapes == {(1, 16), (3, 16), (1, 32)}  # [3], [17], [5, 9], [30], [1]: 1 + 2 rows
    with pytest.raises(ValueError, match="empty prompt"):
        engine.prefill_many(params, [[1, 2], []])


def test_bulk_insert_copies_one_prefix_into_a_group(model):
    engine = Engine(model, num_slots=4, max_len=MAX_LEN)
    _, params = nnx.split(model)
    logp = full_forward_logp(model, MAX_LEN)
    prompt = [9, 8, 7, 6, 5]
    state = engine.bulk_insert(engine.prefill(params, prompt), engine.init_decode_state(), [3, 0, 1],
                               SamplingParams(temperature=1.0, max_new_tokens=3))
    seqs = {s: list(prompt) for s in (0, 1, 3)}
    for step in range(3):
        state, result = engine.generate(params, state, jax.random.key(10 + step))
        r = result.to_host()
        assert list(r.valid) == [True, True, False, True]
        for slot, seq in seqs.items():
            assert abs(r.logprobs[slot] - logp(seq)[-1][r.tokens[slot]]) < 1e-4
            seq.append(int(r.tokens[slot]))
    assert len({tuple(s) for s in seqs.values()}) > 1, "group samples should differ at temperature 1"


def test_continuous_batching_with_random_arrivals_equals_solo_greedy(model):
    rng = random.Random(0)
    logp = full_forward_logp(model, MAX_LEN)
    stop = (3, 11)
    requests = [
        Request(id=i, prompt=[rng.randrange(4, 97) for _ in range(rng.randint(1, 20))],
                max_new_tokens=rng.randint(1, 14), temperature=0.0,
                stop_token_ids=stop if i % 2 else ())
        for i in range(9)
    ]
    engine = Engine(model, num_slots=3, max_len=MAX_LEN)
    _, params = nnx.split(model)
    loop = SamplerLoop(engine, params, seed=1)

    def producer():
        for r in requests:
            time.sleep(rng.uniform(0.0, 0.03))
            loop.submit(r)

    t = threading.Thread(target=producer)
    t.start()
    got = {}
    while len(got) < len(requests):
        c = loop.get_completion(timeout=60)
        assert c is not None, "timed out waiting for a completion"
        got[c.request_id] = c
    t.join()
    stats = loop.stats()
    loop.stop()
    for r in requests:
        c = got[r.id]
        toks, lps, tables = greedy_reference(logp, r.prompt, r.max_new_tokens, r.stop_token_ids)
        assert_greedy_matches(list(c.tokens), list(c.logprobs), toks, lps, tables)
        assert c.finish_reason == ("stop" if toks[-1] in r.stop_token_ids else "length")
        assert (c.versions == 0).all() and c.prompt == list(r.prompt)
    assert stats["generated_tokens"] == sum(len(c.tokens) for c in got.values())
    assert 0 < stats["mean_slot_occupancy"] <= 1 and stats["compile_count"] <= 12


def test_generate_batch_reuses_slots_and_keeps_prompt_order(model):
    logp = full_forward_logp(model, MAX_LEN)
    prompts = [[4, 5], list(range(30, 45)), [60], [7, 8, 9, 10]]
    out = generate_batch(model, prompts, max_new_tokens=5, temperature=0.0, num_slots=2, max_len=MAX_LEN)
    for prompt, c in zip(prompts, out):
        toks, lps, tables = greedy_reference(logp, prompt, 5)
        assert c.prompt == prompt
        assert_greedy_matches(list(c.tokens), list(c.logprobs), toks, lps, tables)


def test_sharded_engine_on_a_mesh_matches_unsharded(model):
    from jax.sharding import Mesh

    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("fsdp", "tensor"))
    engine = Engine(model, num_slots=2, max_len=MAX_LEN, mesh=mesh)
    _, params = nnx.split(model)
    params = engine.place_params(params)
    state = engine.init_decode_state()
    assert all(k.sharding.spec[2] == "tensor" for k in state.cache.k), "kv_heads=2 divides tensor=2: cache must shard"
    logp = full_forward_logp(model, MAX_LEN)
    prompt = [12, 13, 14, 15, 16]
    state = engine.insert(engine.prefill(params, prompt), state, 1, SamplingParams(0.0, max_new_tokens=4))
    toks = []
    for step in range(4):
        state, result = engine.generate(params, state, jax.random.key(step))
        toks.append(int(result.to_host().tokens[1]))
    want, _, _ = greedy_reference(logp, prompt, 4)
    assert toks == want
    assert all(k.sharding.spec[2] == "tensor" for k in state.cache.k), "the step must keep the cache sharding"


def test_engine_rejects_bad_arguments_with_clear_messages(model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(model, num_slots=2, max_len=10_000)
    with pytest.raises(ValueError, match="prefill_buckets"):
        Engine(model, num_slots=2, max_len=32, prefill_buckets=[16, 8])
    engine = Engine(model, num_slots=2, max_len=32, prefill_buckets=[8, 16])
    _, params = nnx.split(model)
    with pytest.raises(ValueError, match="largest prefill bucket"):
        engine.prefill(params, list(range(20)))
    with pytest.raises(ValueError, match="out of range"):
        engine.insert(engine.prefill(params, [1, 2]), engine.init_decode_state(), 5)
    with pytest.raises(ValueError, match="stop token ids"):
        engine.settings(SamplingParams(stop_token_ids=tuple(range(20))))


def test_first_tokens_of_a_group_follow_the_model_softmax(model):
    """Chi-square of many first tokens drawn through bulk_insert + generate (fixed seeds)."""
    slots, rounds = 64, 40
    engine = Engine(model, num_slots=slots, max_len=16)
    _, params = nnx.split(model)
    prefix = engine.prefill(params, [7, 3, 9])
    probs = np.exp(np.asarray(prefix.logprobs, np.float64))
    counts = np.zeros_like(probs)
    state = engine.init_decode_state()
    for i in range(rounds):
        state = engine.bulk_insert(prefix, state, range(slots), SamplingParams(temperature=1.0, max_new_tokens=1))
        state, result = engine.generate(params, state, jax.random.key(100 + i))
        counts += np.bincount(result.to_host().tokens, minlength=probs.size)
    n = slots * rounds
    order = np.argsort(-probs)  # pool the tail so every bin expects >= 5 draws
    big = order[probs[order] * n >= 5]
    rest = np.setdiff1d(order, big)
    obs = np.append(counts[big], counts[rest].sum())
    exp = np.append(probs[big], probs[rest].sum()) * n
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    crit = df * (1 - 2 / (9 * df) + 3.719 * np.sqrt(2 / (9 * df))) ** 3  # upper 1e-4 point
    assert stat < crit, f"chi-square {stat:.1f} over {df} dof"


@pytest.mark.parametrize("prefill_tokens", [None, 16])
def test_insert_sequences_prefills_in_batches(model, prefill_tokens):
    """Two rows per call, or (prefill_tokens=16) one row per call once a bucket is longer than 8 tokens."""
    extra = {} if prefill_tokens is None else {"prefill_tokens": prefill_tokens}
    engine = Engine(model, num_slots=4, max_len=MAX_LEN, prefill_batch=2, **extra)
    assert [engine.prefill_rows_for(n) for n in (8, 16, 32)] == ([2, 2, 2] if prefill_tokens is None else [2, 1, 1])
    _, params = nnx.split(model)
    logp = full_forward_logp(model, MAX_LEN)
    seqs = {3: list(range(4, 30)), 0: [44], 2: [7, 8, 9, 10, 11]}  # 2 calls, one with a padding row
    state = engine.insert_sequences(params, engine.init_decode_state(), list(seqs), list(seqs.values()),
                                    [SamplingParams(temperature=0.0, max_new_tokens=2)] * 3)
    for step in range(2):
        state, result = engine.generate(params, state, jax.random.key(step))
        r = result.to_host()
        assert list(r.valid) == [True, False, True, True]
        for slot, seq in seqs.items():
            want = logp(seq)[-1]
            assert r.tokens[slot] == int(np.argmax(want)) and abs(r.logprobs[slot] - want.max()) < 1e-4
            seq.append(int(r.tokens[slot]))
    assert r.done[[0, 2, 3]].all()
