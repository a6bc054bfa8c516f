"""rollout.paged_attention="auto" (sampler/paged_choice.py): the paged cache's decode attention chosen by timing.

On a GPU "auto" times the gather path and the paged kernel's tilings at the engine's per-device shapes and takes the
kernel only where it compiled, matched the gather path's output and was faster by MARGIN. Here the GPU's choice runs
with `backend="gpu"`, the kernels in the Pallas interpreter (JAX's for power-of-two head widths, the pieced one for
latent attention) and a clock the test sets; one test runs the real clock. A PagedEngine given a choice decodes
greedily as full forwards at the chosen tiling.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import areal_jax.models.paged_attention as pa
from areal_jax.models import Transformer
from areal_jax.models.config_checks import MLA
from areal_jax.models.mla import cache_layout
from areal_jax.sampler import decode_choice as dc
from areal_jax.sampler import paged_choice as pc
from areal_jax.sampler.config import RolloutConfig
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.testing.models import tiny_config
from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward, mesh_across_processes, set_clock

ROWS, PER_ROW, PAGE = 3, 4, 16


def qwen2(**kw):
    return tiny_config("qwen2", **kw)


def choose(cfg=None, timer=None, mesh=None):
    return pc.choose(cfg or qwen2(), ROWS, PER_ROW, PAGE, mesh, backend="gpu", timer=timer, interpret=True)


def names(tilings):
    return [f"kernel {s}x{b}" for s, b in tilings]


def test_candidate_tilings_start_at_gpu_tiling_and_keep_blocks_in_bounds():
    # Qwen2.5-0.5B's sampler: 256 rows x 2 kv heads, 72 pages of 16 (1,152 positions): 2 splits of 8-page blocks
    assert pa.gpu_tiling(256, 2, 72, 16)[1:] == (2, 8)
    assert pc.candidate_tilings(256, 2, 72, 16, 64) == [(2, 8), (4, 8), (2, 16), (2, 4), (4, 4)]
    # latent attention's 576-wide head: the pieced kernel's blocks stay at one page of 16 (576 x 16 x 2 > 16,384)
    assert pc.block_reach(576) == 28
    assert all(b == 1 for _, b in pc.candidate_tilings(64, 1, 1032, 16, 576))
    for rows, per_row, width in ((1, 1, 64), (3, 4, 16), (64, 1032, 128), (8, 5, 96)):
        tilings = pc.candidate_tilings(rows, 2, per_row, 16, width)
        assert tilings[0] == pa.gpu_tiling(rows, 2, per_row, 16, pc.block_reach(width))[1:]
        assert len(set(tilings)) == len(tilings)
        assert all(b >= 1 and s <= -(-per_row // b) for s, b in tilings)


def test_off_gpus_auto_keeps_the_default_path_untimed():
    seen = []
    got = pc.choose(qwen2(), ROWS, PER_ROW, PAGE, backend="cpu", timer=set_clock({}, seen))
    assert got.path == "gather" and "cpu" in got.reason and got.cache == "paged"
    wide = qwen2(head_dim=128)
    got = pc.choose(wide, ROWS, PER_ROW, PAGE, backend="tpu", timer=set_clock({}, seen))
    assert got.path == "kernel" and "Mosaic" in got.reason  # TPUs keep JAX's Mosaic kernel, untimed
    assert not seen
    engine = PagedEngine(Transformer(qwen2(), rngs=nnx.Rngs(0)), num_slots=2, max_len=32)  # the default: auto
    assert engine.attention == "gather" and engine.decode_choice.cache == "paged"
    assert engine.decode_choice.path == "gather" and engine.decode_attention == "xla"  # no dense ragged calls
    assert pc.resolve("kernel", qwen2(), 2, 2, 16).path == "kernel"
    with pytest.raises(ValueError, match="one of auto, gather, kernel"):
        pc.resolve("xla", qwen2(), 2, 2, 16)


def test_the_kernel_is_taken_at_its_fastest_tiling_when_it_beats_the_gather_path():
    cfg = qwen2()
    tilings = pc.candidate_tilings(ROWS, cfg.num_kv_heads, PER_ROW, PAGE, cfg.head_dim)
    assert len(tilings) >= 2
    seconds = {"gather": 100e-6} | {n: 90e-6 for n in names(tilings)}
    fastest = tilings[-1]
    seconds[names([fastest])[0]] = 50e-6
    seen = []
    got = choose(cfg, set_clock(seconds, seen))
    assert got.path == "kernel" and got.tiling == fastest and got.cache == "paged"
    assert seen == (["gather"] + names(tilings)) * dc.REPEATS  # each compiled, matched and was timed a round
    assert got.seconds == pytest.approx(seconds)
    assert "2.00x the gather path's time" in got.reason and "pages a block" in got.describe()
    assert got.as_dict()["cache"] == "paged" and got.as_dict()["tiling"] == f"{fastest[0]}x{fastest[1]}"


def test_a_kernel_within_the_margin_leaves_the_gather_path():
    cfg = qwen2()
    tilings = pc.candidate_tilings(ROWS, cfg.num_kv_heads, PER_ROW, PAGE, cfg.head_dim)
    seconds = {"gather": 100e-6} | {n: 100e-6 * (1 - dc.MARGIN / 2) for n in names(tilings)}
    got = choose(cfg, set_clock(seconds))
    assert got.path == "gather" and got.tiling is None and "only" in got.reason


def test_a_kernel_that_fails_or_differs_is_never_taken(monkeypatch):
    cfg = qwen2()
    tilings = pc.candidate_tilings(ROWS, cfg.num_kv_heads, PER_ROW, PAGE, cfg.head_dim)
    fast = {"gather": 100e-6} | {n: 10e-6 for n in names(tilings)}
    right = pa.kernel_attention

    def broken(*a, **kw):
        raise RuntimeError("Triton could not compile it\nmore detail")

    monkeypatch.setattr(pc, "kernel_attention", broken)
    got = choose(cfg, set_clock(fast))
    assert got.path == "gather" and "no kernel tiling ran" in got.reason and "Triton could not" in got.reason
    assert "more detail" not in got.reason

    monkeypatch.setattr(pc, "kernel_attention", lambda *a, **kw: right(*a, **kw) + 0.5)
    seen = []
    got = choose(cfg, set_clock(fast, seen))
    assert got.path == "gather" and "differs from the gather path's output" in got.reason and seen == ["gather"] * dc.REPEATS

    def first_fails(*a, tiling, **kw):  # one tiling fails: the others still compete
        if tiling == tilings[0]:
            raise RuntimeError("out of shared memory")
        return right(*a, tiling=tiling, **kw)

    monkeypatch.setattr(pc, "kernel_attention", first_fails)
    got = choose(cfg, set_clock(fast))
    assert got.path == "kernel" and got.tiling != tilings[0] and "out of shared memory" in got.reason


def test_latent_attention_races_the_pieced_kernel():
    """Latent attention's one wide head (rank + rope keys, the keys serving as values) goes to the pieced kernel,
    which must match the gather path before it is timed; the fake clock makes it win."""
    cfg = tiny_config("deepseek_v3", head_dim=28, mla=MLA(24, 32, 12, 16, 10))  # a cache 32 + 16 wide
    kv, dh, dv = cache_layout(cfg)
    assert (kv, dv) == (1, 0) and dh & (dh - 1) and dh % 16 == 0  # not a power of two: pieced
    tilings = pc.candidate_tilings(ROWS, kv, PER_ROW, PAGE, dh)
    seen = []
    got = choose(cfg, set_clock({"gather": 100e-6} | {n: 60e-6 for n in names(tilings)}, seen))
    assert got.path == "kernel" and seen == (["gather"] + names(tilings)) * dc.REPEATS


def test_where_no_kernel_applies_the_gather_path_is_kept_untimed():
    seen = []
    timer = set_clock({}, seen)
    assert "sinks" in choose(tiny_config("gpt_oss"), timer).reason
    assert "24 wide" in choose(qwen2(head_dim=24), timer).reason  # neither a power of two nor a multiple of 16
    windowed = qwen2(sliding_window=16)
    assert all(windowed.layer_window(i) is not None for i in range(windowed.num_layers))
    assert "sliding" in choose(windowed, timer).reason
    assert not seen


def test_on_a_tensor_mesh_each_devices_heads_are_timed(monkeypatch):
    seen = []
    monkeypatch.setattr(pc, "choose_shape", lambda *a, **kw: seen.append((a, kw)) or dc.DecodeChoice("gather"))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
    cfg = qwen2()
    choose(cfg, mesh=mesh)
    (rows, per_row, page, heads, kv, dh, dv, _), kw = seen[0]
    assert (rows, per_row, page, heads, kv, dh, dv) == (ROWS, PER_ROW, PAGE, cfg.num_heads // 2,
                                                        cfg.num_kv_heads // 2, cfg.head_dim, cfg.head_dim)
    assert kw["device"] == mesh.devices.flat[0]


def test_a_mesh_across_processes_keeps_the_default_untimed():
    seen = []
    got = choose(timer=set_clock({}, seen), mesh=mesh_across_processes())
    assert "spans processes" in got.reason and not seen


def test_the_real_clock_picks_the_fastest_it_measured(monkeypatch):
    monkeypatch.setattr(dc, "REPEATS", 1)
    monkeypatch.setattr(dc, "INNER", 2)
    monkeypatch.setattr(dc, "_CHOICES", {})
    got = pc.choose_shape(2, 3, 16, 4, 2, 16, 16, jnp.float32, softcap=30.0, interpret=True)
    assert set(got.seconds) == {"gather"} | set(names(pc.candidate_tilings(2, 2, 3, 16, 16)))
    assert all(s > 0 for s in got.seconds.values())
    kernels = {k: v for k, v in got.seconds.items() if k != "gather"}
    best = min(kernels, key=kernels.get)
    assert (got.path == "kernel") == (kernels[best] <= (1 - dc.MARGIN) * got.seconds["gather"])
    assert pc.choose_shape(2, 3, 16, 4, 2, 16, 16, jnp.float32, softcap=30.0) is got  # kept for the process


def test_no_room_to_time_keeps_the_gather_path(monkeypatch):
    monkeypatch.setattr(dc, "_free_bytes", lambda device: 1 << 20)
    got = pc.choose_shape(8, 256, 16, 4, 2, 64, 64, jnp.bfloat16, timer=set_clock({}))
    assert got.path == "gather" and "no room" in got.reason and got.cache == "paged"


def test_a_paged_engine_decodes_greedily_at_the_chosen_tiling(monkeypatch):
    """A PagedEngine whose "auto" chose the kernel at a tiling other than gpu_tiling's passes it to every decode
    call, and decodes greedily as repeated full forwards."""
    cfg = qwen2()
    chosen = (2, 2)
    assert chosen != pa.gpu_tiling(2, cfg.num_kv_heads, 8, 4)[1:]  # 2 slots x 32 positions in pages of 4
    monkeypatch.setattr(pc, "choose", lambda *a, **kw: dc.DecodeChoice("kernel", chosen, reason="test", cache="paged"))
    calls = []
    kernel = pa.kernel_attention
    monkeypatch.setattr(pa, "kernel_attention", lambda *a, **kw: calls.append(kw["tiling"]) or kernel(*a, **kw))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7], [7, 30]], slots=2, page_size=4)
    assert calls and set(calls) == {chosen}


def test_the_config_passes_paged_attention_to_the_engine_and_refuses_it_without_pages():
    assert RolloutConfig().paged_attention == "auto"
    with pytest.raises(ValueError, match="kv_cache"):
        RolloutConfig(paged_attention="gather").check()
    cfg = qwen2()
    rollout = RolloutConfig(kv_cache="paged", paged_attention="kernel", num_slots=2, max_len=32, group_size=1)
    rollout.check()
    engine = rollout.make_engine(Transformer(cfg, rngs=nnx.Rngs(0)), mesh=None, config=cfg)
    assert engine.attention == "kernel" and engine.decode_choice.reason == "as configured"


@pytest.mark.parametrize("rows,heads,kv,width,per_row", [(256, 14, 2, 64, 72), (128, 16, 1, 576, 128)])
def test_every_candidate_tiling_lowers_for_triton(rows, heads, kv, width, per_row):
    """Each tiling "auto" may time lowers through Triton at a real shape (Qwen2.5-0.5B's sampler; latent attention's
    576-wide head through the pieced kernel), with one program per split of each row and kv head, and pages read in
    place: a tiling Triton rejects at lowering fails here, not on a GPU."""
    import re

    from jax import export

    triton = "__gpu$xla.gpu.triton"

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    for splits, block in pc.candidate_tilings(rows, kv, per_row, 16, width):
        def attend(q, k, v, table, positions, tiling=(splits, block)):
            return pa.kernel_attention(q, pa.PagedKVCache((k,), (v,)), 0, table, positions, platform="gpu",
                                       tiling=tiling)

        pages = spec((kv, rows * per_row, 16, width))
        text = export.export(jax.jit(attend), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(
            spec((rows, 1, heads, width)), pages, pages, spec((rows, per_row), jnp.int32),
            spec((rows, 1), jnp.int32)).mlir_module()
        assert f"@{triton}" in text and "stablehlo.gather" not in text
        grids = re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)
        assert grids and all(int(x) * int(y) * int(z) >= rows * kv * splits for x, y, z in grids), grids
