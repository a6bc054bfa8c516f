"""Data-parallel rollout (sampler.replicas): one sampler per row of a (replica, tensor) rollout mesh."""
from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models import logical_to_mesh_sharding
from areal_jax.runtime.mesh import ROLLOUT_AXES, MeshConfig, build_meshes, replica_meshes, rollout_mesh
from areal_jax.sampler import Engine, Request
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.sampler.replicas import SamplerReplicas, split_replicas
from areal_jax.system.params import ParamChannel
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import collect_completions, full_forward_logp, greedy_reference

MAX_LEN = 48
CFG = testing.tiny_config("qwen3")  # 2 kv heads: the cache splits over a tensor axis of 2


@pytest.fixture(scope="module")
def models():
    return testing.random_model(CFG, seed=0), testing.random_model(CFG, seed=1)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ROLLOUT_AXES)


def on_rollout_mesh(model, mesh):
    """The model's params as the ParamChannel lays them out on the rollout mesh."""
    return ParamChannel.for_model(model, mesh).reshard(nnx.split(model)[1])


def test_build_meshes_gives_replicas_and_their_meshes():
    setup = build_meshes(MeshConfig(train_devices=1, rollout_devices=3, rollout_tensor=1))
    assert dict(setup.rollout_mesh.shape) == {"replica": 3, "tensor": 1}
    rows = setup.replica_meshes
    assert [[d.id for d in m.devices.flat] for m in rows] == [[1], [2], [3]]
    assert all(m.axis_names == ROLLOUT_AXES and dict(m.shape) == {"replica": 1, "tensor": 1} for m in rows)
    sub = rollout_mesh(jax.devices()[1:], 1, 2)  # what `evaluate --replicas=1 --tensor=2` builds: a subset, in order
    assert sub.axis_names == ROLLOUT_AXES and [d.id for d in sub.devices.flat] == [1, 2]
    with pytest.raises(ValueError, match="2 rollout replicas x 3 tensor devices do not fit the 4 devices"):
        rollout_mesh(jax.devices()[:4], 2, 3)


def test_weights_replicate_over_replicas_and_split_without_a_copy(models, mesh):
    params = on_rollout_mesh(models[0], mesh)
    rows = replica_meshes(mesh)
    views = split_replicas(params, rows)
    want = jax.tree.leaves(logical_to_mesh_sharding(nnx.split(models[0])[1], rows[0]))
    some_tensor_split = False
    for i, (row, view) in enumerate(zip(rows, views)):
        for whole, part, target in zip(params.leaves, view.leaves, want):
            assert "replica" not in jax.tree.leaves(tuple(whole.sharding.spec))  # a whole copy on every row
            assert part.sharding.mesh == row and part.sharding.spec == target.spec  # what the engine would place
            np.testing.assert_array_equal(np.asarray(part), np.asarray(whole))
            src = {s.device: s.data.unsafe_buffer_pointer() for s in whole.addressable_shards}
            for s in part.addressable_shards:  # the very same device buffers
                assert s.data.unsafe_buffer_pointer() == src[s.device]
            some_tensor_split |= len(part.sharding.device_set) == 2 and not part.sharding.is_fully_replicated
    assert some_tensor_split
    # A leaf that is not on the rollout mesh is passed on as it is (the replica's engine moves it).
    single = nnx.split(models[0])[1]
    for x, y in zip(jax.tree.leaves(single), split_replicas(single, rows)[1].leaves):
        assert x is y


def make_replicas(model, mesh, engine_cls=Engine, **kw):
    extra = dict(page_size=4, num_pages=2 * MAX_LEN // 4) if engine_cls is PagedEngine else {}
    engines = [engine_cls(model, num_slots=2, max_len=MAX_LEN, mesh=m, standby_rows=1, **extra)
               for m in replica_meshes(mesh)]
    return SamplerReplicas(engines, on_rollout_mesh(model, mesh), decode_steps=3, **kw)


@pytest.mark.parametrize("engine_cls", [Engine, PagedEngine])
def test_replicas_serve_every_request_with_single_model_greedy_tokens(models, mesh, engine_cls):
    logp = full_forward_logp(models[0], MAX_LEN)
    requests = [Request(id=i, prompt=[3 + i, 11, 20 + i], max_new_tokens=n, temperature=0.0)
                for i, n in enumerate([9, 4, 12, 6, 7, 3, 10])]
    requests.append(Request(id="group", prompt=[5, 6], max_new_tokens=5, n=2, temperature=0.0))
    sampler = make_replicas(models[0], mesh, engine_cls)
    sampler.pause()
    for r in requests:
        sampler.submit(r)
    owners = dict(sampler._owner)
    sampler.resume()
    done = collect_completions(sampler, 9)
    stats, each = sampler.stats(), [loop.stats() for loop in sampler.loops]
    sampler.stop()
    by_id = {r.id: r for r in requests}
    for c in done:
        want, want_lp, _ = greedy_reference(logp, by_id[c.request_id].prompt, by_id[c.request_id].max_new_tokens)
        assert c.tokens.tolist() == want and c.finish_reason == "length"
        np.testing.assert_allclose(c.logprobs, want_lp, atol=1e-4)
    assert sorted(owners.values()) == [0, 0, 0, 0, 1, 1, 1, 1]  # balanced by samples pending at submission
    assert all(s["generated_tokens"] > 0 for s in each)  # both replicas decoded
    assert stats["generated_tokens"] == sum(len(c.tokens) for c in done) == sum(s["generated_tokens"] for s in each)
    assert stats["replicas"] == 2 and 0 < stats["mean_slot_occupancy"] <= 1
    assert not sampler._owner and not sampler._left  # forgotten once every sample came back
    if engine_cls is PagedEngine:
        assert all(e.allocator.free_pages == e.num_pages for e in sampler.engines)


def test_update_reaches_every_replica_and_abort_its_owner(models, mesh):
    old, new = models
    sampler = make_replicas(old, mesh, seed=5)
    sampler.pause()
    requests = [Request(id=i, prompt=[4 + i, 9], max_new_tokens=8, temperature=0.0) for i in range(4)]
    for r in requests:
        sampler.submit(r)
    sampler.update_params(on_rollout_mesh(new, mesh), version=3)  # applied before the first dispatch
    sampler.abort(2)
    sampler.resume()
    done = collect_completions(sampler, 4)
    deadline = time.time() + 10
    while sampler.current_version != 3 and time.time() < deadline:
        time.sleep(0.02)
    version, params = sampler.versioned_params()
    sampler.stop()
    logp = full_forward_logp(new, MAX_LEN)
    for c in done:
        if c.request_id == 2:
            assert c.finish_reason == "interrupted" and len(c.tokens) == 0
            continue
        assert (c.versions == 3).all() and c.tokens.tolist() == greedy_reference(logp, c.prompt, 8)[0]
    assert version == 3 and sampler.current_version == 3
    assert all(loop.current_version == 3 for loop in sampler.loops)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(nnx.split(new)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sampler.get_completion(timeout=0.1) is None  # stopped and drained


def test_a_failing_replica_is_reported_and_the_others_stop(models, mesh):
    sampler = make_replicas(models[0], mesh)

    def fail(*args, **kwargs):
        raise RuntimeError("device lost")

    sampler.loops[1].engine.generate_steps = fail
    sampler.pause()
    for i in range(4):
        sampler.submit(Request(id=i, prompt=[4 + i, 9], max_new_tokens=6, temperature=0.0))
    sampler.resume()
    with pytest.raises(Exception, match="device lost"):
        collect_completions(sampler, 4, timeout=60)
    with pytest.raises(Exception, match="device lost"):
        sampler.stop(graceful=False, timeout=30)
    assert not any(loop.alive for loop in sampler.loops)


@pytest.mark.slow
def test_job_with_two_rollout_replicas(tmp_path):
    import json
    import os

    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config

    steps, eta = 3, 1
    c = tiny_config(str(tmp_path), eta=eta, steps=steps)
    c.mesh.train_devices, c.mesh.rollout_devices, c.mesh.rollout_tensor = 2, 2, 1
    c.eval.n_test, c.eval.samples, c.eval.at_start, c.eval.at_end = 6, 1, True, False  # on both replicas too
    job = RLJob(c, log_fn=lambda *a, **k: None)
    try:
        assert isinstance(job.sampler, SamplerReplicas) and job.sampler.replicas == 2
        summary = job.run()
        deadline = time.time() + 10
        while job.sampler.current_version != steps and time.time() < deadline:
            time.sleep(0.05)
        trainer_params = jax.tree.leaves(job.trainer.params)
        for loop, row in zip(job.sampler.loops, job.meshes.replica_meshes):
            version, params = loop.versioned_params()
            assert version == steps
            for a, b in zip(jax.tree.leaves(params), trainer_params):
                assert a.sharding.device_set == set(row.devices.flat)  # each replica decodes on its own device
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert loop.stats()["generated_tokens"] > 0
        assert summary["evaluations"]["start"]["n"] == 6
        assert all(e.mesh == m for e, m in zip(job._evaluator.engine(), job.meshes.replica_meshes))
        one_copy = sum(x.nbytes for x in trainer_params)
        assert job.memory.rollout["sampler_params"] == one_copy  # the plan: a whole copy per rollout device
        assert job.channel.last_bytes == 2 * one_copy  # a publish writes one copy on each replica
    finally:
        job.close()
    with open(os.path.join(c.run_dir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert summary["steps"] == steps and len(rows) == steps * c.train.batch_groups
    assert all(r["trained_version"] - r["min_token_version"] <= eta for r in rows)
