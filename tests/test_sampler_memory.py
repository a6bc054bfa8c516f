"""The sampler programs' working memory as the job plans it (sampler.memory), against XLA's analysis of the
full-depth programs, and the bounds that keep a long prefill's memory in check (query blocks, rows per call)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from areal_jax import config as config_lib
from areal_jax.knobs import ConfigError
from areal_jax.models import cache_attention
from areal_jax.runtime.mesh import MeshConfig, build_meshes
from areal_jax.sampler import memory as sampler_memory
from areal_jax.sampler.config import RolloutConfig
from areal_jax.system import memory as job_memory
from areal_jax.testing import models as testing

CFG = testing.tiny_config(num_layers=5, vocab_size=512, dtype=jnp.float32, param_dtype=jnp.float32,
                          max_position_embeddings=8192)


@pytest.mark.parametrize("rollout,tensor", [
    (dict(num_slots=16, max_len=512, decode_steps=4), 1),
    (dict(num_slots=16, max_len=512, decode_steps=4), 2),  # kv heads and weights split over a 2-device tensor axis
    (dict(num_slots=8, max_len=1024, decode_steps=2, kv_cache="paged", kv_pages=-1, kv_admission="optimistic",
          param_dtype="bfloat16"), 1),
])
def test_two_shallow_programs_predict_the_full_depth_sampler_memory(rollout, tensor):
    r = RolloutConfig(**rollout)
    mesh = Mesh(np.array(jax.devices()[:tensor]).reshape(1, tensor), ("fsdp", "tensor")) if tensor > 1 else None
    longest = sampler_memory.longest_prefill(r, 64)
    assert longest == r.max_len  # recompute on update: in-flight sequences are re-prefilled up to max_len
    for program in sampler_memory.PROGRAMS:
        probe = sampler_memory.program_bytes(r, CFG, mesh, program, longest=longest)
        full = sampler_memory.program_temp_bytes(r, CFG, mesh, layers=CFG.num_layers, program=program, longest=longest)
        assert probe > 0 and abs(probe - full) <= 0.01 * full, (program, probe, full)


@pytest.mark.long  # 14-42 s; the hybrid families' memory plans against the engine's layout: test_falcon_h1 / test_jamba
def test_a_hybrid_models_sampler_memory_adds_each_kind_of_layers_own_step():
    """Qwen3.5's Gated DeltaNet layers (a float32 state per slot, the chunked rule in a prefill) need far more
    working memory than its attention layers here: each kind is probed apart (attention alone gave 0.08 of the
    decode dispatch's and 0.24 of the prefill's)."""
    hybrid = testing.wide_hybrid_config(dtype=jnp.float32, param_dtype=jnp.float32)
    r = RolloutConfig(num_slots=16, max_len=512, decode_steps=4)
    longest = sampler_memory.longest_prefill(r, 64)
    for program in sampler_memory.PROGRAMS:
        probe = sampler_memory.program_bytes(r, hybrid, None, program, longest=longest)
        full = sampler_memory.program_temp_bytes(r, hybrid, None, layers=8, program=program, longest=longest,
                                                 kind="model")
        assert abs(probe - full) <= 0.03 * full, (program, probe, full)


def test_the_longest_prefill_follows_what_can_be_re_prefilled():
    r = RolloutConfig(max_len=2048)
    assert sampler_memory.longest_prefill(r, 100) == 2048  # a weight update recomputes in-flight sequences
    assert sampler_memory.longest_prefill(r.replace(on_update="continue"), 100) == 100  # only prompts
    assert sampler_memory.longest_prefill(r.replace(on_update="continue"), 4096) == 2048
    paged = r.replace(on_update="continue", kv_cache="paged", kv_admission="optimistic")
    assert sampler_memory.longest_prefill(paged, 100) == 2048  # a preempted sample resumes by recompute


def test_a_long_prefill_is_scored_in_query_blocks(monkeypatch):
    """At one pass over the cache (the accelerator default), a 4,096-token prefill of 4 rows at 8 heads would
    score 2 GiB at once; in query blocks its whole program needs less than one such score tensor."""
    cfg = testing.tiny_config(num_layers=2, num_heads=8, num_kv_heads=2, vocab_size=512, dtype=jnp.float32,
                              param_dtype=jnp.float32, max_position_embeddings=8192)
    monkeypatch.setattr(cache_attention, "cache_chunk_size", lambda s, backend=None: min(s, cache_attention.ACCELERATOR_CACHE_CHUNK))
    r = RolloutConfig(num_slots=4, group_size=4, max_len=4096, on_update="continue")
    scores = 4 * 8 * 4096 * 4096 * 4
    assert cache_attention.query_block_size(4, 4096, 8, 4096) == 1024
    blocked = sampler_memory.program_temp_bytes(r, cfg, None, layers=2, program="prefill", longest=4096)
    monkeypatch.setattr(cache_attention, "query_block_size", lambda rows, queries, *a, **k: queries)  # one block
    whole = sampler_memory.program_temp_bytes(r, cfg, None, layers=2, program="prefill", longest=4096)
    assert blocked < scores and whole >= 2 * scores, (blocked, whole)  # measured: 1.7 and 6.5 GB


def test_the_job_plan_adds_the_sampler_programs_where_the_device_has_a_limit():
    job = config_lib.from_config_dict({"rollout": {"num_slots": 8, "max_len": 256}, "eval": {"n_test": 0},
                                       "train": {"micro_batch_tokens": 256}, "data": {"max_prompt_len": 32}})
    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    none = job_memory.JobMemory.prepare(job, CFG, meshes, None)
    resolved = none.resolve_rollout(job, meshes.rollout_mesh)  # standby rows for data.max_prompt_len's bucket
    assert resolved == job.rollout.for_prompts(32) and resolved.standby_len == 32 and job.rollout.standby_len is None
    assert "sampler_programs" not in none.plan.parts  # a CPU reports no limit: nothing compiled

    need = sampler_memory.sampler_bytes(resolved, CFG, meshes.rollout_mesh, max_prompt_len=32)
    resident = none.plan.total
    roomy = job_memory.JobMemory.prepare(job, CFG, meshes, 4 * (resident + max(need.values())))
    roomy.resolve_rollout(job, meshes.rollout_mesh)
    assert roomy.plan.parts["sampler_programs"] == max(need.values())
    assert roomy.plan.total == resident + max(need.values())

    tight = job_memory.JobMemory.prepare(job, CFG, meshes, int((resident + max(need.values()) // 2) / 0.9))
    with pytest.raises(ConfigError, match="does not fit its devices"):
        tight.resolve_rollout(job, meshes.rollout_mesh)
    assert "sampler_programs" in tight.plan.describe()


@pytest.mark.long  # 20 s; the probes against full depth: the two-shallow-programs test above
def test_the_benchmark_reports_probe_and_full_depth_at_the_qwen_shape(monkeypatch, capsys):
    import json
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["sampler_memory.py"])
    import sampler_memory as bench

    report = bench.main(["--preset", "qwen2.5-0.5b", "--dtype", "float32", "--num-slots", "8", "--max-len", "384",
                         "--decode-steps", "2", "--full", "--unbounded", "--accelerator-chunks"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    assert report["longest_prefill"] == 384 and report["accelerator_chunks"]
    for program in sampler_memory.PROGRAMS:
        assert abs(report[f"{program}_probe_bytes"] / report[f"{program}_full_bytes"] - 1) < 0.01, program
    assert report["prefill_unbounded_bytes"] >= report["prefill_full_bytes"]  # 8 rows of 384: within the bounds
    assert cache_attention.query_block_size(8, 384, 14, 384) == 384  # ... so nothing was split


def test_an_evaluation_adds_its_streams_programs_to_the_evaluation_part():
    from areal_jax.evaluation.batch import eval_engine

    job = config_lib.from_config_dict({"eval": {"n_test": 10, "num_slots": 16, "max_new_tokens": 32, "decode_steps": 4,
                                                "streams": 2},
                                       "data": {"max_prompt_len": 24}, "rollout": {"max_len": 96, "num_slots": 8},
                                       "train": {"micro_batch_tokens": 128}})
    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    ev = job_memory.eval_rollout(job, "cpu")
    assert (ev.num_slots, ev.max_len, ev.decode_steps, ev.standby) == (8, 56, 4, 4)  # 16 slots over 2 streams
    # the probe's stand-in engine holds what the evaluation's own engine holds
    engine = eval_engine(testing.random_model(CFG), config=CFG, num_slots=16, max_len=56, streams=2, decode_steps=4,
                         longest_prompt=24)
    stand_in = ev.make_engine(testing.random_model(CFG), mesh=None, config=CFG)
    assert (stand_in.num_slots, stand_in.max_len, stand_in.standby_rows) == (engine.num_slots, engine.max_len,
                                                                             engine.standby_rows)
    plain = job_memory.JobMemory.prepare(job, CFG, meshes, None)
    memory = job_memory.JobMemory.prepare(job, CFG, meshes, 100 * plain.plan.total)
    memory.add_sampler(job, meshes.rollout_mesh)
    programs = sampler_memory.sampler_bytes(ev, CFG, meshes.rollout_mesh, max_prompt_len=24)
    assert memory.rollout["evaluation"] == plain.rollout["evaluation"] + 2 * max(programs.values())
    assert sampler_memory.longest_prefill(ev, 24) == 24  # an evaluation prefills prompts only


def test_the_job_says_so_while_it_measures_programs():
    job = config_lib.from_config_dict({"rollout": {"num_slots": 8, "max_len": 128}, "eval": {"n_test": 0},
                                       "train": {"micro_batch_tokens": 128}, "data": {"max_prompt_len": 32},
                                       "mesh": {"device_memory_gib": 64}})
    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    lines: list[str] = []
    memory = job_memory.JobMemory.for_job(job, CFG, meshes, log=lines.append)
    assert memory.device_bytes == 64 * 2**30 and not lines
    memory.resolve_update(job.train, meshes.train_mesh)
    assert len(lines) == 1 and "measuring the working memory" in lines[0]
    quiet = job_memory.JobMemory.for_job(job.replace(mesh=job.mesh.replace(device_memory_gib=None)), CFG, meshes,
                                         log=lines.append)
    quiet.resolve_update(job.train, meshes.train_mesh)  # a CPU reports no limit: nothing measured, nothing said
    assert len(lines) == 1
