"""decode_attention="auto" (sampler/decode_choice.py): the dense cache's decode attention chosen by timing.

On a GPU "auto" times XLA's path and the ragged kernel's tilings at the engine's per-device shapes and takes the
kernel only where it compiled, matched XLA's output and was faster by MARGIN. Here the GPU's choice runs with
`backend="gpu"`, the kernel in the Pallas interpreter and a clock the test sets, so each rule is checked against a
known answer; one test runs the real clock too. An Engine given a choice decodes greedily as full forwards at the
chosen tiling.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import areal_jax.models.ragged_decode as rd
from areal_jax.models import Transformer
from areal_jax.sampler import decode_choice as dc
from areal_jax.sampler.config import RolloutConfig
from areal_jax.sampler.engine import Engine
from areal_jax.testing.models import tiny_config
from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward, mesh_across_processes, set_clock

ROWS, MAX_LEN = 3, 64


def qwen2(**kw):
    return tiny_config("qwen2", **kw)


def choose(cfg=None, timer=None, mesh=None):
    return dc.choose(cfg or qwen2(), ROWS, MAX_LEN, mesh, backend="gpu", timer=timer, interpret=True)


def test_candidate_tilings_start_at_the_default_and_keep_a_block_per_split():
    # Qwen2.5-0.5B at 256 slots: 256 rows x 2 kv heads = 512 programs, so one split of 128-position blocks
    assert rd.default_tiling(256, 14, 2, 1152, 64)[:2] == (128, 1)
    assert dc.candidate_tilings(256, 14, 2, 1152, 64) == [(1, 128), (2, 128), (1, 64), (2, 64)]
    # 4 rows, 1 kv head, 32 positions: blocks of 32, one block -> no room to split; half blocks of 16 split in two
    assert dc.candidate_tilings(4, 2, 1, 32, 16) == [(1, 32), (1, 16), (2, 16)]
    for rows, max_len in ((1, 16), (3, 64), (64, 16512)):
        tilings = dc.candidate_tilings(rows, 12, 2, max_len, 128)
        assert tilings[0] == rd.default_tiling(rows, 12, 2, max_len, 128)[1::-1]
        assert all(b >= 16 and s <= rd.blocks_per_row(max_len, b) for s, b in tilings)


def test_off_gpus_auto_is_xla_and_times_nothing():
    seen = []
    got = dc.choose(qwen2(), ROWS, MAX_LEN, backend="cpu", timer=set_clock({}, seen))
    assert got.path == "xla" and "cpu" in got.reason and not seen
    engine = Engine(Transformer(qwen2(), rngs=nnx.Rngs(0)), num_slots=2, max_len=32)  # the default: auto
    assert engine.decode_attention == "xla" and engine.decode_choice.path == "xla"
    assert dc.resolve("kernel", qwen2(), 2, 32).path == "kernel"


def test_the_kernel_is_taken_at_its_fastest_tiling_when_it_beats_xla():
    tilings = dc.candidate_tilings(ROWS, 4, 2, MAX_LEN, 16)
    assert len(tilings) >= 2
    seconds = {"xla": 100e-6} | {f"kernel {s}x{b}": 90e-6 for s, b in tilings}
    fastest = tilings[-1]
    seconds[f"kernel {fastest[0]}x{fastest[1]}"] = 40e-6
    seen = []
    got = choose(timer=set_clock(seconds, seen))
    assert got.path == "kernel" and got.tiling == fastest
    # every candidate timed once a round, in rounds
    assert seen == (["xla"] + [f"kernel {s}x{b}" for s, b in tilings]) * dc.REPEATS
    assert got.seconds == pytest.approx(seconds)
    assert "2.50x" in got.reason and "kernel" in got.describe() and got.spent > 0 and "chosen in" in got.describe()
    assert got.as_dict()["tiling"] == f"{fastest[0]}x{fastest[1]}"


def test_a_kernel_within_the_margin_leaves_xla():
    tilings = dc.candidate_tilings(ROWS, 4, 2, MAX_LEN, 16)
    slower = {"xla": 100e-6} | {f"kernel {s}x{b}": 100e-6 * (1 - dc.MARGIN / 2) for s, b in tilings}
    got = choose(timer=set_clock(slower))
    assert got.path == "xla" and got.tiling is None and "only" in got.reason


def test_a_kernel_that_fails_or_differs_is_never_taken(monkeypatch):
    tilings = dc.candidate_tilings(ROWS, 4, 2, MAX_LEN, 16)
    fast = {"xla": 100e-6} | {f"kernel {s}x{b}": 10e-6 for s, b in tilings}
    right = rd.ragged_decode_attention

    def broken(*a, **kw):
        raise RuntimeError("Triton could not compile it\nmore detail")

    monkeypatch.setattr(rd, "ragged_decode_attention", broken)
    got = choose(timer=set_clock(fast))
    assert got.path == "xla" and "no kernel tiling ran" in got.reason and "Triton could not compile it" in got.reason
    assert "more detail" not in got.reason  # one line per failure

    monkeypatch.setattr(rd, "ragged_decode_attention", lambda *a, **kw: right(*a, **kw) + 0.5)
    seen = []
    got = choose(timer=set_clock(fast, seen))
    assert got.path == "xla" and "differs from XLA's output" in got.reason
    assert seen == ["xla"] * dc.REPEATS  # a wrong kernel is not even timed

    def first_fails(*a, splits, block, **kw):  # one tiling fails: the others still compete
        if (splits, block) == tilings[0]:
            raise RuntimeError("out of shared memory")
        return right(*a, splits=splits, block=block, **kw)

    monkeypatch.setattr(rd, "ragged_decode_attention", first_fails)
    got = choose(timer=set_clock(fast))
    assert got.path == "kernel" and got.tiling != tilings[0] and "out of shared memory" in got.reason


def test_caches_the_kernel_does_not_take_keep_xla_untimed():
    seen = []
    timer = set_clock({}, seen)
    assert choose(qwen2(head_dim=24), timer).path == "xla"  # not a power of two
    assert choose(tiny_config("deepseek_v3"), timer).path == "xla"  # latent attention's one wide head
    windowed = qwen2(sliding_window=16)
    assert all(windowed.layer_window(i) is not None for i in range(windowed.num_layers))
    assert "sliding" in choose(windowed, timer).reason
    assert not seen
    for cfg in (qwen2(head_dim=24), tiny_config("deepseek_v3"), windowed):
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        assert Engine(model, num_slots=2, max_len=32).decode_attention == "xla"


def test_on_a_tensor_mesh_each_devices_heads_are_timed(monkeypatch):
    seen = []
    monkeypatch.setattr(dc, "choose_shape", lambda *a, **kw: seen.append((a, kw)) or dc.DecodeChoice("xla"))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
    cfg = qwen2()
    choose(cfg, mesh=mesh)
    (rows, max_len, heads, kv, dh, dv, _), kw = seen[0]
    assert (rows, max_len, heads, kv, dh, dv) == (ROWS, MAX_LEN, cfg.num_heads // 2, cfg.num_kv_heads // 2,
                                                   cfg.head_dim, cfg.head_dim)
    assert kw["device"] == mesh.devices.flat[0]


def test_the_real_clock_picks_the_fastest_it_measured(monkeypatch):
    monkeypatch.setattr(dc, "REPEATS", 1)
    monkeypatch.setattr(dc, "INNER", 2)
    monkeypatch.setattr(dc, "_CHOICES", {})
    got = dc.choose_shape(2, 32, 2, 1, 16, 16, jnp.float32, softcap=30.0, sinks=True, interpret=True)
    kernels = {k: v for k, v in got.seconds.items() if k != "xla"}
    assert set(got.seconds) == {"xla"} | {f"kernel {s}x{b}" for s, b in dc.candidate_tilings(2, 2, 1, 32, 16)}
    assert all(s > 0 for s in got.seconds.values())
    best = min(kernels, key=kernels.get)
    assert (got.path == "kernel") == (kernels[best] <= (1 - dc.MARGIN) * got.seconds["xla"])
    assert dc.choose_shape(2, 32, 2, 1, 16, 16, jnp.float32, softcap=30.0, sinks=True) is got  # kept


def test_no_room_to_time_keeps_xla(monkeypatch):
    monkeypatch.setattr(dc, "_free_bytes", lambda device: 1 << 20)
    got = dc.choose_shape(8, 4096, 4, 2, 64, 64, jnp.bfloat16, timer=set_clock({}))
    assert got.path == "xla" and "no room" in got.reason


def test_an_engine_decodes_greedily_at_the_chosen_tiling(monkeypatch):
    """An Engine whose "auto" chose the kernel at a tiling other than the default passes that tiling to every
    decode call, and decodes greedily as repeated full forwards."""
    cfg = qwen2()
    default = rd.default_tiling(2, cfg.num_heads, cfg.num_kv_heads, 32, cfg.head_dim)
    chosen = (2, 16)
    assert chosen != default[1::-1]
    monkeypatch.setattr(dc, "choose", lambda *a, **kw: dc.DecodeChoice("kernel", chosen, reason="test"))
    calls = []
    kernel = rd.ragged_decode_attention
    monkeypatch.setattr(rd, "ragged_decode_attention",
                        lambda *a, **kw: calls.append((kw["splits"], kw["block"])) or kernel(*a, **kw))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7], [7, 30]], slots=2, decode_attention="auto")
    assert calls and set(calls) == {chosen}


def test_the_config_takes_auto_with_either_cache():
    assert RolloutConfig().decode_attention == "auto"
    RolloutConfig(kv_cache="paged").check()  # auto is the dense cache's; the paged cache keeps its own kernel
    with pytest.raises(ValueError, match="paged"):
        RolloutConfig(kv_cache="paged", decode_attention="kernel").check()


def test_a_mesh_across_processes_keeps_xla_untimed():
    seen = []
    got = choose(timer=set_clock({}, seen), mesh=mesh_across_processes())
    assert got.path == "xla" and "spans processes" in got.reason and not seen


def test_when_timing_xla_fails_xla_is_kept_with_the_reason():
    def timer(name, run):
        raise MemoryError("RESOURCE_EXHAUSTED: out of memory while trying to allocate\ndetail")

    got = choose(timer=timer)
    assert got.path == "xla" and "RESOURCE_EXHAUSTED" in got.reason and "detail" not in got.reason


def test_rounds_give_each_candidate_its_best_and_a_kernel_failing_later_drops_out():
    """The timed runs go in rounds (one of each candidate a round): a slow spell in one round costs no candidate its
    best round, and a kernel whose timed run fails is dropped with its error while the others compete."""
    tilings = dc.candidate_tilings(ROWS, 4, 2, MAX_LEN, 16)
    names = ["xla"] + [f"kernel {s}x{b}" for s, b in tilings]
    calls = {n: 0 for n in names}

    def timer(name, run):
        calls[name] += 1
        if name == names[1] and calls[name] == 3:
            raise RuntimeError("an illegal memory access\ndetail")
        slow = 10.0 if calls[name] == 2 else 1.0  # the second round is slow for everyone
        return slow * {"xla": 100e-6, names[-1]: 60e-6}.get(name, 90e-6) * dc.INNER

    got = choose(timer=timer)
    assert got.path == "kernel" and got.tiling == tilings[-1]
    assert got.seconds["xla"] == pytest.approx(100e-6) and got.seconds[names[-1]] == pytest.approx(60e-6)
    assert names[1] not in got.seconds and "illegal memory access" in got.reason and "detail" not in got.reason
    assert calls[names[1]] == 3 and all(calls[n] == dc.REPEATS for n in names if n != names[1])
