"""The sampler over a paged KV cache: the dense engine's tokens, pages limited by memory, groups sharing prompts."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from flax import nnx

from areal_jax.sampler import Engine, Request, SamplerLoop
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import full_forward_logp, serve

MAX_LEN = 40
CFG = testing.tiny_config("qwen2")


@pytest.fixture(scope="module")
def models():
    return testing.random_model(CFG, seed=0), testing.random_model(CFG, seed=1)


def test_paged_loop_gives_the_dense_tokens_with_fewer_pages_than_slots_need(models):
    requests = [Request(id=i, prompt=[4 + i] * (3 + 2 * i), max_new_tokens=n, temperature=0.0)
                for i, n in enumerate([9, 3, 14, 6, 11])]
    requests.append(Request(id="g", prompt=[7, 8, 9, 10, 11, 12], max_new_tokens=7, n=3, temperature=0.0))
    params = nnx.split(models[0])[1]
    dense = serve(Engine(models[0], num_slots=4, max_len=MAX_LEN), params, requests, decode_steps=3)
    # 4 slots x 40 positions would be 40 pages of 4; the pool has 14, so memory, not slots, bounds the batch.
    engine = PagedEngine(models[0], num_slots=4, max_len=MAX_LEN, page_size=4, num_pages=14)
    paged = serve(engine, params, requests, decode_steps=3)
    logp = full_forward_logp(models[0], MAX_LEN)
    for a, b in zip(dense, paged):
        assert (a.request_id, a.sample_index) == (b.request_id, b.sample_index) and b.finish_reason == "length"
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        want = [logp(list(b.prompt) + b.tokens[:i].tolist())[-1].max() for i in range(len(b.tokens))]
        np.testing.assert_allclose(b.logprobs, want, atol=1e-4)
    assert engine.allocator.free_pages == 14 and not engine.allocator.refcount.any(), "every page came back"
    assert 1 <= engine.peak_active <= 4


def test_group_prompt_pages_are_shared_while_the_samples_run(models):
    engine = PagedEngine(models[0], num_slots=3, max_len=MAX_LEN, page_size=4, num_pages=30)
    params = nnx.split(models[0])[1]
    tables = []  # the page table at each dispatch: what the running samples read (no race with a pause)
    dispatch = engine.generate_steps

    def recording_generate_steps(*args, **kwargs):
        tables.append(engine.allocator.table.copy())
        return dispatch(*args, **kwargs)

    engine.generate_steps = recording_generate_steps
    loop = SamplerLoop(engine, params, decode_steps=2)
    loop.submit(Request(id="g", prompt=list(range(5, 18)), max_new_tokens=20, n=3, temperature=1.0))
    done = [loop.get_completion(timeout=120) for _ in range(3)]
    loop.stop()
    assert len(tables) >= 2
    table = tables[1]  # the second dispatch: all three samples decoding
    # 13 prompt positions = 3 full pages shared by the 3 samples, then a page of their own each
    assert (table[0, :3] == table[1, :3]).all() and (table[1, :3] == table[2, :3]).all()
    assert len({int(table[s, 3]) for s in range(3)}) == 3
    logp = full_forward_logp(models[0], MAX_LEN)
    for c in done:
        seq = list(c.prompt)
        for tok, lp in zip(c.tokens, c.logprobs):
            assert abs(logp(seq)[-1][tok] - lp) < 1e-4, "each sample reads only its own tokens"
            seq.append(int(tok))
    assert engine.allocator.free_pages == 30


def test_recompute_update_over_pages_keeps_version_tags_exact(models):
    old, new = models
    engine = PagedEngine(old, num_slots=3, max_len=MAX_LEN, page_size=4, num_pages=24)
    # The update is handed over while the loop's third dispatch waits, so it lands mid-generation however
    # fast or slow the machine is (a pause after a polled step count could be overrun by the samples).
    dispatch, calls = engine.generate_steps, []
    reached, go = threading.Event(), threading.Event()

    def held_third_dispatch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            reached.set()
            assert go.wait(60)
        return dispatch(*args, **kwargs)

    engine.generate_steps = held_third_dispatch
    loop = SamplerLoop(engine, nnx.split(old)[1], seed=3, decode_steps=2)
    loop.pause()
    loop.submit(Request(id="g", prompt=[5, 17, 23, 42, 8], max_new_tokens=16, n=2))
    loop.submit(Request(id="s", prompt=[6, 17, 23], max_new_tokens=16))
    loop.resume()
    assert reached.wait(120)
    loop.update_params(nnx.split(new)[1], version=7)
    go.set()
    done = [loop.get_completion(timeout=120) for _ in range(3)]
    loop.stop()
    logps = {0: full_forward_logp(old, MAX_LEN), 7: full_forward_logp(new, MAX_LEN)}
    mixed = 0
    for c in done:
        mixed += len(set(c.versions.tolist())) == 2
        seq = list(c.prompt)
        for tok, lp, ver in zip(c.tokens, c.logprobs, c.versions):
            assert abs(logps[int(ver)](seq)[-1][tok] - lp) < 1e-4
            seq.append(int(tok))
    assert mixed == 3  # every sample: its first tokens of version 0, the rest of version 7


def test_a_group_larger_than_the_pool_runs_a_sample_at_a_time(models):
    # each sample may reach 2 + 30 positions = 8 pages of 4; the pool holds 10, so one sample runs at a time
    engine = PagedEngine(models[0], num_slots=2, max_len=MAX_LEN, page_size=4, num_pages=10)
    done = serve(engine, nnx.split(models[0])[1], [Request(id="big", prompt=[4, 5], max_new_tokens=30, n=2)],
                 decode_steps=4)
    assert [len(c.tokens) for c in done] == [30, 30] and engine.peak_active == 1
    assert engine.allocator.free_pages == 10


def test_config_switch_is_validated():
    from areal_jax import config as config_lib

    c = config_lib.base_config()
    c.rollout.kv_cache = "paged"
    c.rollout.kv_pages = 3
    with pytest.raises(config_lib.ConfigError, match=r"--config.rollout.kv_pages=3 cannot hold one sequence"):
        config_lib.validate(c, check_paths=False)
    c.rollout.kv_cache = "pages"
    with pytest.raises(config_lib.ConfigError, match="rollout.kv_cache='pages' is not one of dense, paged"):
        config_lib.validate(c, check_paths=False)


@pytest.mark.slow
@pytest.mark.parametrize("admission", ["reserve", "optimistic"])
def test_rl_job_runs_on_the_paged_cache(tmp_path, admission):
    import json
    import os

    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config

    c = tiny_config(str(tmp_path), eta=1, steps=2)
    c.rollout.kv_cache, c.rollout.page_size, c.rollout.kv_admission = "paged", 8, admission
    if admission == "optimistic":  # a pool of two longest sequences for all the slots
        c.rollout.kv_pages = 2 * -(-c.rollout.max_len // 8)
    job = RLJob(c, log_fn=lambda *a, **k: None)
    try:
        assert isinstance(job.engine, PagedEngine) and job.engine.admission == admission
        summary = job.run()
    finally:
        job.close()
    assert summary["steps"] == 2
    with open(os.path.join(c.run_dir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert rows and all(len(r["rewards"]) == c.rollout.group_size for r in rows)
    with open(os.path.join(c.run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    logged = [m for m in metrics if "sampler/preempted" in m]
    assert logged and (logged[-1]["sampler/preempted"] == 0) == (admission == "reserve")


@pytest.mark.slow
def test_paged_engine_through_the_pallas_kernel_gives_the_gather_tokens(models):
    """The Pallas GPU paged-attention kernel (interpreted on the CPU) inside the engine's decode step."""
    requests = [Request(id=0, prompt=[4, 5, 6, 7, 8], max_new_tokens=6, temperature=0.0),
                Request(id=1, prompt=[9, 10], max_new_tokens=4, temperature=0.0)]
    params = nnx.split(models[0])[1]
    runs = {}
    for path in ("gather", "kernel"):
        engine = PagedEngine(models[0], num_slots=2, max_len=16, page_size=4, attention=path)
        runs[path] = serve(engine, params, requests, decode_steps=3)
    assert engine.pages_per_slot == 16  # the kernel's table is padded to whole partitions
    for a, b in zip(runs["gather"], runs["kernel"]):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize("attention", ["gather", "kernel"])
def test_pages_split_their_kv_heads_over_the_rollout_tensor_axis(models, attention):
    """On a rollout mesh with tensor = 2 the pages hold half the kv heads per device (the memory plan counts so), the
    kernel path runs per head shard, and the tokens are the single-device engine's."""
    import jax
    from jax.sharding import Mesh

    from areal_jax.system.memory import kv_cache_bytes

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tensor"))
    requests = [Request(id=i, prompt=[4 + i] * (3 + 2 * i), max_new_tokens=n, temperature=0.0)
                for i, n in enumerate([6, 9, 4])]
    requests.append(Request(id="g", prompt=[7, 8, 9, 10, 11], max_new_tokens=5, n=2, temperature=0.0))
    params = nnx.split(models[0])[1]
    want = serve(PagedEngine(models[0], num_slots=3, max_len=MAX_LEN, page_size=4, attention=attention), params,
                 requests, decode_steps=2)
    engine = PagedEngine(models[0], num_slots=3, max_len=MAX_LEN, page_size=4, attention=attention, mesh=mesh)
    state = engine.init_decode_state()
    pages = state.cache.pages.k[0]
    assert pages.sharding.spec[0] == "tensor" and pages.addressable_shards[0].data.shape[0] == CFG.num_kv_heads // 2
    got = serve(engine, params, requests, decode_steps=2)
    for a, b in zip(want, got):
        assert (a.request_id, a.sample_index) == (b.request_id, b.sample_index)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)

    class Rollout:  # the fields kv_cache_bytes reads
        kv_cache, num_slots, standby, max_len, page_size, kv_pages = "paged", 3, 0, MAX_LEN, 4, None

    per_device = kv_cache_bytes(CFG, Rollout, tensor=2)
    logits = 3 * CFG.vocab_size * 4
    assert 2 * (per_device - logits) == kv_cache_bytes(CFG, Rollout, tensor=1) - logits
