"""The device memory plan: the update's working memory from two shallow programs, the resident parts from
shapes, train.remat=auto, and the error that names the part to shrink.

References: XLA's own memory analysis of the full-depth program (for the 1- and 2-layer extension), and
the arrays a real Trainer and Engine allocate (for the parts computed from shapes).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from areal_jax import config as config_lib
from areal_jax.knobs import ConfigError
from areal_jax.models.lora import LoRAConfig
from areal_jax.runtime.mesh import MeshConfig, build_meshes
from areal_jax.sampler.config import RolloutConfig
from areal_jax.system import memory as job_memory
from areal_jax.testing import models as testing
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig, memory
from areal_jax.trainer.memory import resident_bytes

CFG = testing.tiny_config(num_layers=4, vocab_size=256, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                          max_position_embeddings=1024)


def one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))


@pytest.mark.parametrize("case", ["plain", "lora_dots", "critic_kl_dense", "scan_full", "small_micro_step"])
def test_two_shallow_programs_predict_the_full_depth_update_memory(case):
    build, wrt = job_memory.model_builder(None, 0), nnx.Param
    cfg = TrainerConfig(micro_batch_tokens=512, logits_chunk=128)
    if case == "lora_dots":
        build, wrt = job_memory.model_builder(LoRAConfig(enabled=True, rank=4), 0), nnx.LoRAParam
        cfg = cfg.replace(remat="dots")
    if case == "critic_kl_dense":
        cfg = cfg.replace(critic="value_head", kl_coef=0.1, attention="dense")
    if case == "scan_full":  # probed with 2 and 3 layers: a single layer is not scanned
        cfg = cfg.replace(scan_layers=True, remat="full")
    if case == "small_micro_step":  # the optimizer step needs more than a 16-token micro-step
        cfg = cfg.replace(micro_batch_tokens=16, logits_chunk=16)
    mesh = one_device_mesh()
    predicted = memory.activation_bytes(build, CFG, cfg, mesh, wrt=wrt)
    full = {p: memory.update_temp_bytes(build, CFG, cfg, mesh, layers=CFG.num_layers, wrt=wrt, program=p)
            for p in ("accumulate", "apply")}
    assert min(full.values()) > 0
    if case == "small_micro_step":
        assert full["apply"] > full["accumulate"]
    assert abs(predicted - max(full.values())) <= 0.01 * max(full.values()), (predicted, full)


@pytest.mark.long  # (excluded from the default run: `-m long`)
def test_a_hybrid_models_update_memory_adds_each_kind_of_layers_own_step():
    """Qwen3.5: Gated DeltaNet layers (the chunked rule's [chunk, chunk] matrices per head) and attention layers
    grow the update by different steps, each probed on copies of its own kind; the sum predicts the real model's
    full-depth program (probes of attention alone gave 0.58 of it at 8 layers and 2,048 tokens)."""
    hybrid = testing.wide_hybrid_config(5, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    assert memory.layer_counts(hybrid) == {"attention": 1, "linear": 4}
    build, mesh = job_memory.model_builder(None, 0), one_device_mesh()
    cfg = TrainerConfig(micro_batch_tokens=1024, logits_chunk=128)
    predicted = memory.program_bytes(build, hybrid, cfg, mesh, "accumulate")
    full = memory.update_temp_bytes(build, hybrid, cfg, mesh, layers=5, kind="model")
    attention_only = memory.extended_to_depth(lambda n: memory.update_temp_bytes(build, hybrid, cfg, mesh, layers=n), 5, 1)
    assert abs(predicted - full) <= 0.02 * full, (predicted, full)
    assert attention_only < 0.8 * full  # what the plan would have missed
    with pytest.raises(ValueError, match="kind must be one of"):
        memory.update_temp_bytes(build, hybrid, cfg, mesh, layers=3, kind="model")


def test_choose_remat_takes_the_least_recomputation_that_fits(monkeypatch):
    need = {"none": 100, "dots": 60, "full": 30}
    asked = []

    def fake(build, model_cfg, cfg, mesh, program, **kw):
        if program == "apply":  # the optimizer step: smaller than any micro-step here
            return 0
        asked.append(cfg.remat)
        return need[cfg.remat]

    monkeypatch.setattr(memory, "program_bytes", fake)
    auto = TrainerConfig(remat="auto")

    def choose(held, device, cfg=auto):
        asked.clear()
        return memory.choose_remat(None, CFG, cfg, None, held_bytes=held, device_bytes=device, headroom=1.0)

    assert choose(10, 200) == ("none", 100) and asked == ["none"]
    assert choose(120, 200) == ("dots", 60) and asked == ["none", "dots"]
    assert choose(150, 200) == ("full", 30)
    assert choose(190, 200) == ("full", 30)  # nothing fits: the least memory, and the plan's check says so
    assert choose(10, None) == ("none", None) and asked == []  # no limit (a CPU): nothing measured
    assert choose(10, None, TrainerConfig(remat="dots")) == ("dots", None) and asked == []
    assert choose(190, 200, TrainerConfig(remat="none")) == ("none", 100)  # a named choice stays, measured


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_resident_parts_equal_what_a_trainer_and_an_engine_allocate(kv_cache):
    # 4 CPU devices split in two slices: params and moments sharded over fsdp=2, the cache over rollout tensor=2
    job = config_lib.from_config_dict({
        "rollout": {"num_slots": 8, "max_len": 96, "kv_cache": kv_cache, "page_size": 16, "param_dtype": "bfloat16",
                    "decode_steps": 4},
        "train": {"kl_coef": 0.05, "micro_batch_tokens": 128}, "data": {"max_prompt_len": 32}})
    meshes = build_meshes(job.mesh)
    assert not meshes.colocated and meshes.train_mesh.shape["fsdp"] == 2
    build = job_memory.model_builder(None, 0)
    train, rollout = job_memory.state_parts(job, CFG, meshes, build)

    model, ref = build(CFG), build(CFG)
    trainer = Trainer(model, job.train, meshes.train_mesh, ref_model=ref)
    assert train["params"] == resident_bytes(trainer.state.params)
    assert 0 <= resident_bytes(trainer.state.opt_state) - train["optimizer"] <= 16  # + the step counters
    assert train["gradients"] == train["params"]  # float32 params: float32 accumulators
    assert train["reference"] == resident_bytes(trainer._ref)
    rollout_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model))
    shardings = job_memory.logical_to_mesh_sharding(rollout_params, meshes.rollout_mesh)
    assert rollout["sampler_params"] == resident_bytes(jax.device_put(rollout_params, shardings))

    # the job's engine: standby rows as long as data.max_prompt_len's bucket (32 of max_len 96)
    engine = job.rollout.for_prompts(job.data.max_prompt_len).make_engine(model, mesh=meshes.rollout_mesh, config=CFG)
    state = engine.init_decode_state()
    if kv_cache == "dense":
        assert engine.standby_len == 32 and state.standby.cache.k[0].shape[1] == 32
    # keys and values (a dense cache splits its kv heads over the two devices, the page pool is replicated),
    # the standby rows' cache (dense; paged standby rows hold pages of the pool) and every row's logits
    cache = [state.cache, state.logits, state.standby.logits] + ([state.standby.cache] if kv_cache == "dense" else [])
    got = resident_bytes(cache)
    table = state.cache.table.nbytes if kv_cache == "paged" else 0  # the page table, not counted
    assert got - table == rollout["kv_cache"], (got, table, rollout["kv_cache"])


@pytest.mark.parametrize("form", ["plain", "merged", "unmerged"])
def test_the_sampler_weight_parts_equal_what_a_hand_off_holds(form):
    """The sampler's weights, with merged LoRA the base it folds the adapters into, and the next version's copy that
    a hand-off makes beside the current one: each part equals the arrays a real update and channel hold, on 4 CPU
    devices split in two slices (the plain model's update writes the copy on the train devices, the channel moves
    it; LoRA moves the adapters and, merged, folds them into a fresh copy)."""
    from areal_jax.models import FlatParams
    from areal_jax.system.lora_channel import AdapterChannel
    from areal_jax.system.params import ParamChannel

    lora = {"enabled": form != "plain", "rank": 4, "targets": "attn", "sampler": "unmerged" if form == "unmerged"
            else "merged"}
    job = config_lib.from_config_dict({"rollout": {"num_slots": 8, "max_len": 96, "param_dtype": "bfloat16"},
                                       "lora": lora, "train": {"micro_batch_tokens": 128}, "data": {"max_prompt_len": 32}})
    meshes = build_meshes(job.mesh)
    assert not meshes.colocated
    build = job_memory.model_builder(job.lora if form != "plain" else None, 0)
    wrt = nnx.Param if form == "plain" else nnx.LoRAParam
    train, rollout = job_memory.state_parts(job, CFG, meshes, build, wrt)
    trainer = Trainer(build(CFG), job.train, meshes.train_mesh, wrt=wrt)
    if form == "plain":
        assert set(rollout) >= {"sampler_params", "handoff"} and "lora_base" not in rollout
        trainer.keep_sampler_copy(jnp.bfloat16)
        trainer.update(random_trajectories(4, vocab=CFG.vocab_size, seed=0, max_len=32))
        copy = trainer.sampler_copy()  # the update's output, on the train devices
        assert train["handoff"] == resident_bytes(copy)
        channel = ParamChannel.for_model(trainer.params, meshes.rollout_mesh, train_mesh=meshes.train_mesh,
                                         dtype=jnp.bfloat16)
        moved = channel.publish(1, copy, owned=True)
        assert rollout["handoff"] == rollout["sampler_params"] == resident_bytes(moved)
        return
    assert "handoff" not in train  # only the adapters cross, from the trainer's own buffers
    channel = AdapterChannel(trainer.params, meshes.rollout_mesh, scale=job.lora.scale, mode=form,
                             dtype=jnp.bfloat16, train_mesh=meshes.train_mesh)
    weights = channel.publish(1, FlatParams.of(trainer.state.params))
    adapters = resident_bytes(channel._adapters.reshard(FlatParams.of(trainer.state.params)))
    assert rollout["sampler_params"] == resident_bytes(weights)
    if form == "merged":  # the base stays on the rollout devices beside the merged copy it makes
        assert rollout["lora_base"] == resident_bytes(channel.base)
        assert rollout["handoff"] == resident_bytes(weights) + adapters
    else:  # the sampler decodes the base and the adapters themselves
        assert "lora_base" not in rollout and rollout["handoff"] == adapters
        assert rollout["sampler_params"] == resident_bytes(channel.base) + adapters


def test_a_plan_over_the_device_names_the_largest_part_and_its_key():
    job = config_lib.from_config_dict({"rollout": {"num_slots": 64, "max_len": 1024}, "eval": {"n_test": 0}})
    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    parts = job_memory.JobMemory.prepare(job, CFG, meshes, device_bytes=None)  # no limit: nothing checked
    total = parts.plan.total
    assert max(parts.plan.parts, key=parts.plan.parts.get) == "kv_cache"
    with pytest.raises(ConfigError) as e:
        job_memory.JobMemory.prepare(job, CFG, meshes, device_bytes=total)  # 90% of it is too little
    msg = str(e.value)
    assert "This run does not fit its devices" in msg and "The largest part is kv_cache" in msg
    assert "--config.rollout.num_slots" in msg and "--config.rollout.kv_cache=paged" in msg


def test_the_job_plan_adds_the_measured_update_and_resolves_auto():
    job = config_lib.from_config_dict({"rollout": {"num_slots": 8, "max_len": 128}, "eval": {"n_test": 0},
                                       "train": {"micro_batch_tokens": 1024, "logits_chunk": 256, "attention": "dense"},
                                       "data": {"max_prompt_len": 32}})
    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    resident = job_memory.JobMemory.prepare(job, CFG, meshes, None).plan.total
    act = memory.activation_bytes(job_memory.model_builder(None, 0), CFG, job.train, meshes.train_mesh)

    roomy = job_memory.JobMemory.prepare(job, CFG, meshes, device_bytes=4 * (resident + act))
    cfg = roomy.resolve_update(job.train, meshes.train_mesh)
    assert cfg.remat == "none" and roomy.plan.parts["update_activations"] == act
    assert roomy.plan.total == resident + act

    # Room for the resident parts but not the update: on the CPU every remat needs the same memory
    # (XLA:CPU's scheduler), so even "full" does not fit and the error names the update's keys.
    tight = job_memory.JobMemory.prepare(job, CFG, meshes, device_bytes=int((resident + act // 2) / 0.9))
    with pytest.raises(ConfigError) as e:
        tight.resolve_update(job.train, meshes.train_mesh)
    assert act > max(tight.plan.parts[k] for k in tight.plan.parts if k != "update_activations")
    # auto tried none, dots and full (alike on the CPU): the error says what is left to change
    assert "The largest part is update_activations: even with train.remat=full, lower" in str(e.value)
    assert "--config.train.micro_batch_tokens" in str(e.value)
    named = job_memory.JobMemory.prepare(job, CFG, meshes, device_bytes=int((resident + act // 2) / 0.9))
    with pytest.raises(ConfigError, match="update_activations: set --config.train.remat=full"):
        named.resolve_update(job.train.replace(remat="none"), meshes.train_mesh)  # a named remat: try full

    none = job_memory.JobMemory.prepare(job, CFG, meshes, None)
    assert none.resolve_update(job.train, meshes.train_mesh).remat == "none"  # a CPU: auto is none, nothing measured
    assert "update_activations" not in none.plan.parts


@pytest.mark.long  # 23 s; auto's resolution in a job plan: test_the_job_plan_adds_the_measured_update_and_resolves_auto
def test_a_trainer_resolves_auto_to_a_remat_with_the_same_update(monkeypatch):
    trajs = random_trajectories(6, vocab=CFG.vocab_size, seed=3, max_len=40)
    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=128, logits_chunk=64, prox_mode="loglinear")
    results = {}
    for limit in (None, 1):  # no limit (the CPU), then 1 byte: nothing fits, so the least memory ("full")
        monkeypatch.setattr(memory, "device_memory_bytes", lambda *a, limit=limit, **k: limit)
        model = testing.random_model(dataclasses.replace(CFG, dtype=jnp.float32), seed=0)
        trainer = Trainer(model, cfg, one_device_mesh())
        assert trainer.cfg.remat == ("none" if limit is None else "full")
        assert (trainer.activation_bytes is None) == (limit is None)
        results[trainer.cfg.remat] = trainer.update(trajs)
    for key in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose(results["full"][key], results["none"][key], rtol=1e-5, atol=1e-6)


def test_rollout_config_builds_the_engine_it_names():
    from areal_jax.sampler.paged_engine import PagedEngine

    model = testing.random_model(CFG)
    dense = RolloutConfig(num_slots=8, max_len=64).make_engine(model, mesh=None, config=CFG)
    paged = RolloutConfig(num_slots=8, max_len=64, kv_cache="paged", kv_pages=20).make_engine(model, mesh=None,
                                                                                              config=CFG)
    assert type(dense).__name__ == "Engine" and isinstance(paged, PagedEngine) and paged.num_pages == 20


def test_a_lora_plan_counts_adapters_as_trained_and_the_bf16_base_as_frozen():
    job = config_lib.from_config_dict({"lora": {"enabled": True, "rank": 4, "targets": "attn",
                                                "base_dtype": "bfloat16"}})
    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    build = job_memory.model_builder(job.lora, job.seed)
    train, _ = job_memory.state_parts(job, CFG, meshes, build, nnx.LoRAParam)
    trainer = Trainer(build(CFG), TrainerConfig(), meshes.train_mesh, wrt=nnx.LoRAParam)
    assert train["params"] == resident_bytes(trainer.state.params)  # the adapters only
    assert train["frozen_weights"] == resident_bytes(trainer._other)  # the base, in bf16
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(trainer._other) if x.ndim == 2)
    assert 0 <= resident_bytes(trainer.state.opt_state) - train["optimizer"] <= 16
    assert train["frozen_weights"] > 10 * train["params"]


def test_the_evaluation_part_equals_what_an_evaluation_engine_holds():
    from areal_jax.evaluation.batch import eval_engine

    job = config_lib.from_config_dict({"eval": {"n_test": 10, "num_slots": 16, "max_new_tokens": 32,
                                                "decode_steps": 4, "streams": 2},
                                       "data": {"max_prompt_len": 24}, "rollout": {"max_len": 96},
                                       "train": {"micro_batch_tokens": 128}})
    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    _, rollout = job_memory.state_parts(job, CFG, meshes, job_memory.model_builder(None, 0))
    model = testing.random_model(CFG)
    engine = eval_engine(model, config=CFG, num_slots=16, max_len=56, mesh=meshes.rollout_mesh, streams=2,
                         decode_steps=4, longest_prompt=24)  # 24 + 32 tokens, as the job sizes it
    state = engine.init_decode_state()
    assert engine.num_slots == 8 and state.standby is not None  # two streams of 8 slots, with standby rows
    assert engine.standby_len == 24  # as long as the longest prompt's bucket
    per_stream = resident_bytes([state.cache, state.logits, state.standby.cache, state.standby.logits])
    weights = rollout["sampler_params"]
    assert rollout["evaluation"] == weights + 2 * per_stream
    off = config_lib.from_config_dict({"eval": {"n_test": 0}})
    assert job_memory.state_parts(off, CFG, meshes, job_memory.model_builder(None, 0))[1]["evaluation"] == 0


def test_the_update_and_an_evaluation_never_count_together():
    plan = job_memory.MemoryPlan({"params": 10, "kv_cache": 5, "update_activations": 7, "evaluation": 4}, 100)
    assert plan.total == 22 and "the larger counts" in plan.describe()
    assert job_memory.MemoryPlan({"params": 10, "evaluation": 4}, 100).total == 14
    assert job_memory.plan({"params": 10, "update_activations": 30}, {"kv_cache": 20, "evaluation": 15}, False,
                           None).parts == {"params": 10, "update_activations": 30}  # split slices: the larger side


def test_kv_pages_minus_one_fills_the_memory_the_plan_leaves():
    job = config_lib.from_config_dict({
        "rollout": {"num_slots": 8, "max_len": 96, "kv_cache": "paged", "page_size": 16, "kv_pages": -1,
                    "kv_admission": "optimistic"},
        "train": {"micro_batch_tokens": 128}, "data": {"max_prompt_len": 32}, "eval": {"n_test": 0}})
    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    assert job_memory.JobMemory.prepare(job, CFG, meshes, None).fill_pages(job.rollout).kv_pages is None  # no limit

    least = job_memory.JobMemory.prepare(job, CFG, meshes, None).plan.total  # a one-sequence pool (6 pages)
    page = 16 * job_memory.kv_position_bytes(CFG, 1, split=False)  # 16 KiB: a float32 cache on the CPU
    budget = int((least + 1000 * page) / job_memory.HEADROOM)  # room for about 1,000 more pages
    memory = job_memory.JobMemory.prepare(job, CFG, meshes, budget)
    filled = memory.fill_pages(job.rollout)
    assert 1000 <= filled.kv_pages <= 1006
    assert memory.plan.total <= job_memory.HEADROOM * budget  # it fits...
    more = job_memory.kv_cache_bytes(CFG, filled.replace(kv_pages=filled.kv_pages + 1), 1)
    assert memory.plan.total - memory.rollout["kv_cache"] + more > job_memory.HEADROOM * budget  # ...and is the most
    engine = filled.make_engine(testing.random_model(CFG), mesh=meshes.rollout_mesh, config=CFG)
    state = engine.init_decode_state()
    assert engine.num_pages == filled.kv_pages
    held = resident_bytes([state.cache.pages, state.logits, state.standby.logits])
    assert held == memory.rollout["kv_cache"]  # the pool as planned

    with pytest.raises(ConfigError, match="kv_pages=-1 sizes a page pool"):
        config_lib.from_config_dict({"rollout": {"kv_pages": -1}})


def test_every_process_plans_against_the_smallest_limit_any_reports():
    from areal_jax.runtime.multihost import agreed_limit, combine_limits

    assert combine_limits(np.array([80 * 2**30, 141 * 2**30])) == 80 * 2**30  # the smallest GPU bounds every process
    assert combine_limits(np.array([80 * 2**30, -1])) is None  # a process without a limit: nothing is checked
    assert combine_limits(np.array([[-1], [-1]])) is None
    assert agreed_limit(123) == 123 and agreed_limit(None) is None  # one process: its own (no collective)


def test_a_plan_that_does_not_fit_an_expert_parallel_update_names_the_switch():
    """Where a mixture of experts trains expert-parallel on the train mesh (its row buffers grow with the micro-batch's
    tokens over all devices), an update that does not fit also names model.expert_parallel; elsewhere it does not."""
    from areal_jax.testing.models import tiny_config

    moe = tiny_config("qwen3_moe", num_layers=1)  # 4 experts
    mesh = build_meshes(MeshConfig(colocated=True, fsdp=4, tensor=1)).train_mesh
    one = build_meshes(MeshConfig(), devices=jax.devices()[:1]).train_mesh
    assert job_memory.expert_parallel_on(moe, mesh)
    assert not job_memory.expert_parallel_on(moe.replace(expert_parallel=False), mesh)
    assert not job_memory.expert_parallel_on(moe, one) and not job_memory.expert_parallel_on(CFG, mesh)
    assert not job_memory.expert_parallel_on(moe.replace(num_experts=6), mesh)  # 6 do not split four ways
    job = config_lib.from_config_dict({"rollout": {"num_slots": 8, "max_len": 96}, "eval": {"n_test": 0},
                                       "train": {"micro_batch_tokens": 256, "logits_chunk": 64, "remat": "full",
                                                 "attention": "dense"}, "data": {"max_prompt_len": 16}})
    meshes = build_meshes(MeshConfig(colocated=True, fsdp=4, tensor=1))
    resident = job_memory.JobMemory.prepare(job, moe, meshes, None).plan.total
    gather = moe.replace(expert_dispatch="gather")
    tight = job_memory.JobMemory.prepare(job, gather, meshes, device_bytes=int(resident / 0.9) + 1)
    with pytest.raises(ConfigError, match=r"update_activations: .*expert_dispatch=ring .*expert_parallel=false"):
        tight.resolve_update(job.train, meshes.train_mesh)
    tight = job_memory.JobMemory.prepare(job, moe, meshes, device_bytes=int(resident / 0.9) + 1)  # auto: both tried
    with pytest.raises(ConfigError, match=r"by gather or ring \(both measured\): --config.model.expert_parallel"):
        tight.resolve_update(job.train, meshes.train_mesh)


def test_auto_dispatch_takes_the_ring_where_only_it_fits():
    """model.expert_dispatch=auto (the default): on a budget between the ring's update and the all-gather's the plan
    takes the ring (and says so); on a roomy one it keeps the all-gather, as at the same recomputation it moves fewer
    bytes; an explicit gather on the tight budget fails naming the ring."""
    from areal_jax.testing.models import tiny_config
    from areal_jax.trainer.memory import choose_remat

    moe = tiny_config("qwen3_moe", num_layers=1, num_experts=8, moe_intermediate_size=16)
    assert moe.expert_dispatch == "auto"
    job = config_lib.from_config_dict({"rollout": {"num_slots": 8, "max_len": 96}, "eval": {"n_test": 0},
                                       "train": {"micro_batch_tokens": 1024, "logits_chunk": 64, "remat": "full",
                                                 "attention": "dense"}, "data": {"max_prompt_len": 16}})
    meshes = build_meshes(MeshConfig(colocated=True, fsdp=4, tensor=1))
    base = job_memory.JobMemory.prepare(job, moe, meshes, None)
    held = sum(v for k, v in {**base.train, **base.rollout}.items() if k not in job_memory.EXCLUSIVE)
    need = {d: choose_remat(base.build, moe.replace(expert_dispatch=d), job.train, meshes.train_mesh, held_bytes=0,
                            device_bytes=2**40, wrt=base.wrt)[1] for d in ("gather", "ring")}
    assert need["ring"] < need["gather"]  # 4 devices' rows gathered against one visitor's
    between = int((held + (need["ring"] + need["gather"]) / 2) / job_memory.HEADROOM)
    lines: list[str] = []
    mem = job_memory.JobMemory.prepare(job, moe, meshes, device_bytes=between)
    mem.log = lines.append
    mem.resolve_update(job.train, meshes.train_mesh)
    assert mem.model.expert_dispatch == "ring" and mem.train["update_activations"] == need["ring"]
    assert any("model.expert_dispatch=auto takes the ring" in line for line in lines)
    roomy = job_memory.JobMemory.prepare(job, moe, meshes, device_bytes=2**40)
    roomy.resolve_update(job.train, meshes.train_mesh)
    assert roomy.model.expert_dispatch == "gather" and roomy.train["update_activations"] == need["gather"]
    explicit = job_memory.JobMemory.prepare(job, moe.replace(expert_dispatch="gather"), meshes, device_bytes=between)
    with pytest.raises(ConfigError, match=r"expert_dispatch=ring holds one device's at a time"):
        explicit.resolve_update(job.train, meshes.train_mesh)
