"""The dense cache's ragged decode kernel (models/ragged_decode.py), run in the Pallas interpreter on the CPU.

It must give `cached_attention`'s answer (and a softmax written in numpy) for every row length, including none,
partial last blocks, rows past the cache's end, split positions and grouped heads; the sampler's Engine with
decode_attention="kernel" must decode greedily as repeated full forwards do, alone and on a tensor-parallel mesh;
the config refuses what it cannot run. Its Triton lowering is checked in test_accelerator_lowering.py; on a GPU the
kernel-level tests here run it compiled (`gpu_session.sh ragged`), at TF32's tolerance for float32 products."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models import Transformer
from areal_jax.models import ragged_decode as rd
from areal_jax.models.cache_attention import cached_attention, ragged_decode_calls
from areal_jax.sampler.config import RolloutConfig
from areal_jax.testing.models import tiny_config
from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

ATOL = 2e-6 if jax.default_backend() != "gpu" else 5e-3  # Triton takes float32 products in TF32


def numpy_attention(q, k, v, lengths, softcap=None):
    """q [B, H, D], k / v [B, S, K, D], lengths [B] -> [B, H, D]: each head's softmax over its kv head's first
    lengths[b] positions, in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros((b, h, v.shape[3]))
    for r in range(b):
        n = int(lengths[r])
        for head in range(h):
            if n == 0:
                continue
            scores = k[r, :n, head // group] @ q[r, head] / np.sqrt(d)
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            p = np.exp(scores - scores.max())
            out[r, head] = p @ v[r, :n, head // group] / p.sum()
    return out


def inputs(b, s, h, kv, d, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, 1, h, d), dtype), jax.random.normal(ks[1], (b, s, kv, d), dtype),
            jax.random.normal(ks[2], (b, s, kv, d), dtype))


@pytest.mark.parametrize("s,h,kv,d,softcap,block,splits", [
    (40, 14, 2, 64, None, None, None),  # Qwen2.5-0.5B's heads; 40 positions: the last 32-block shifted back
    (40, 14, 2, 64, None, 16, 3),  # three splits of 16-position blocks, the last one short
    (160, 4, 4, 32, 30.0, 32, 2),  # one query head per kv head (padded to 16), a score cap
    (48, 8, 1, 16, None, 16, 4)])  # one kv head for eight query heads
def test_the_kernel_equals_cached_attention_and_numpy_at_every_row_length(s, h, kv, d, softcap, block, splits):
    positions = np.array([-1, 0, 1, 15, 16, 17, s // 2, s - 2, s - 1, s + 5], np.int32)  # none .. all, and past
    q, k, v = inputs(len(positions), s, h, kv, d)
    lengths = np.clip(positions + 1, 0, s)
    got = rd.ragged_decode_attention(q[:, 0], k, v, jnp.asarray(lengths), softcap=softcap, block=block,
                                     splits=splits)
    want = cached_attention(q, k, v, jnp.asarray(positions)[:, None], softcap=softcap, counted=True)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q[:, 0], k, v, lengths, softcap), atol=ATOL)
    assert not np.asarray(got[0]).any()  # a row with no position attends nothing


@pytest.mark.parametrize("splits", [1, 2])
def test_attention_sinks_join_the_softmax_as_cached_attention_has_them(splits):
    """gpt-oss's sinks (a logit per query head, one more key of value zero) are joined where the splits combine:
    the same output as cached_attention's, rows with no position still zero."""
    positions = np.array([-1, 0, 5, 20, 39], np.int32)
    q, k, v = inputs(len(positions), 40, 8, 2, 32)
    sinks = jax.random.normal(jax.random.key(7), (8,)) * 2
    got = rd.ragged_decode_attention(q[:, 0], k, v, jnp.asarray(np.clip(positions + 1, 0, 40)), sinks=sinks,
                                     block=16, splits=splits)
    want = cached_attention(q, k, v, jnp.asarray(positions)[:, None], sinks=sinks, counted=True)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL)
    assert not np.asarray(got[0]).any()
    plain = rd.ragged_decode_attention(q[:, 0], k, v, jnp.asarray(np.clip(positions + 1, 0, 40)), block=16,
                                       splits=splits)
    assert np.abs(np.asarray(plain[1:]) - np.asarray(got[1:])).max() > 1e-3  # the sinks take weight


def test_positions_past_each_rows_length_change_nothing_and_past_its_last_block_are_never_read():
    """Keys and values past a row's length (here 1e4 times larger) leave its output alone, and past the block
    holding its last position (here NaN) the kernel reads nothing: its loop stops there."""
    q, k, v = inputs(4, 64, 4, 2, 32)
    lengths = jnp.array([1, 17, 33, 50], jnp.int32)
    index = jnp.arange(64)[None, :, None, None]
    after = index >= lengths[:, None, None, None]
    unread = index >= (-(-lengths // 16) * 16)[:, None, None, None]
    poisoned = [jnp.where(unread, jnp.nan, jnp.where(after, 1e4 * x[::-1], x)) for x in (k, v)]
    for splits in (1, 4):
        got = rd.ragged_decode_attention(q[:, 0], *poisoned, lengths, block=16, splits=splits)
        want = rd.ragged_decode_attention(q[:, 0], k, v, lengths, block=16, splits=splits)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bfloat16_caches_match_the_float32_answer_to_bf16_precision():
    q, k, v = inputs(3, 64, 8, 2, 64, jnp.bfloat16)
    lengths = np.array([5, 40, 64], np.int32)
    got = rd.ragged_decode_attention(q[:, 0], k, v, jnp.asarray(lengths))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), numpy_attention(q[:, 0], k, v, lengths), atol=2e-2)


def test_tiling_worked_by_hand():
    # Qwen2.5-0.5B at 256 slots of 1,152: 128-position blocks, 256 x 2 programs already, so one split.
    assert rd.tiling(256, 2, 1152, 64) == (128, 1, 1152)
    # 64 rows of 16k at 128-wide heads: 64 x 2 x 4 = 512 programs, 32 blocks a split.
    assert rd.tiling(64, 2, 16384, 128) == (128, 4, 4096)
    # 256-wide heads: 64-position blocks (16,384 elements); 8 rows x 4 kv heads -> 16 splits (the most).
    assert rd.tiling(8, 4, 8192, 256) == (64, 16, 512)
    # a cache of 40 positions: 32-position blocks, at most 2 splits (one block each).
    assert rd.tiling(1, 1, 40, 16) == (32, 2, 32)


def test_supports_and_the_decode_path_check():
    assert rd.supports(64, 64, 16) and rd.supports(256, 256, 8192)
    assert not rd.supports(80, 80, 64) and not rd.supports(64, 64, 8) and not rd.supports(8, 8, 64)
    assert rd.decode_path("kernel", "gpu") == "kernel" and rd.decode_path("xla", "tpu") == "xla"
    with pytest.raises(ValueError, match="GPU"):
        rd.decode_path("kernel", "tpu")
    with pytest.raises(ValueError, match="not one of"):
        rd.decode_path("pallas", "gpu")
    with pytest.raises(ValueError, match="paged"):
        RolloutConfig(kv_cache="paged", decode_attention="kernel").check()
    RolloutConfig(decode_attention="kernel").check()


def test_cached_attention_takes_the_kernel_only_where_it_applies(monkeypatch):
    """Inside `ragged_decode_calls`, decode calls over the whole cache go through the kernel (same answer, with
    sinks too); a window, several queries or an unsupported width keep the XLA path."""
    calls = []
    kernel = rd.ragged_decode_attention
    monkeypatch.setattr(rd, "ragged_decode_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    q, k, v = inputs(3, 32, 4, 2, 16)
    positions = jnp.array([[3], [20], [31]], jnp.int32)
    want = cached_attention(q, k, v, positions, counted=True)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    want_sinks = cached_attention(q, k, v, positions, sinks=sinks, counted=True)
    with ragged_decode_calls(True):
        got = cached_attention(q, k, v, positions)
        assert len(calls) == 1
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL)
        np.testing.assert_allclose(np.asarray(cached_attention(q, k, v, positions, sinks=sinks)),
                                   np.asarray(want_sinks), atol=ATOL)
        assert len(calls) == 2
        cached_attention(q, k, v, positions, window=8)
        cached_attention(jnp.tile(q, (1, 2, 1, 1)), k, v, jnp.tile(positions, (1, 2)))
        wide = inputs(3, 32, 4, 2, 24)
        cached_attention(*wide, positions)
    assert len(calls) == 2
    cached_attention(q, k, v, positions)  # outside the context: XLA
    assert len(calls) == 2


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "gpt_oss"])  # gemma2: a score cap, and ring-cached sliding
# layers beside; gpt_oss: attention sinks (and sliding layers, experts)
def test_an_engine_with_the_kernel_decodes_greedily_as_full_forwards(arch, monkeypatch):
    calls = []
    kernel = rd.ragged_decode_attention
    monkeypatch.setattr(rd, "ragged_decode_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    model = Transformer(tiny_config(arch), rngs=nnx.Rngs(0))
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         slots=2, decode_attention="kernel")
    assert calls  # the dispatch traced the kernel


def test_on_a_tensor_parallel_mesh_the_kernel_runs_on_each_devices_heads():
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("fsdp", "tensor"))
    model = Transformer(tiny_config("qwen2"), rngs=nnx.Rngs(1))
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40], [7, 30, 31]], slots=2, mesh=mesh,
                                         decode_attention="kernel")


@pytest.mark.parametrize("normalised", [True, False])
def test_combine_splits_is_the_softmax_over_every_split(normalised):
    """Per-split softmax pieces (normalised as this kernel writes them, or unnormalised as `paged_pieces` does;
    one split empty) combine to the softmax over all positions, with and without a sink, worked in float64."""
    rng = np.random.default_rng(0)
    scores, values = rng.normal(size=(3, 12)) * 3, rng.normal(size=(12, 5))
    bounds = [(0, 5), (5, 5), (5, 12)]  # the middle split saw nothing
    o, m, l_sum = [], [], []
    for lo, hi in bounds:
        s = scores[:, lo:hi]
        top = s.max(axis=1) if hi > lo else np.full(3, np.finfo(np.float32).min)
        p = np.exp(s - top[:, None])
        out = p @ values[lo:hi]
        o.append(out / np.maximum(p.sum(1), 1e-30)[:, None] if normalised else out)
        m.append(top)
        l_sum.append(p.sum(1))
    o, m, l_sum = (jnp.asarray(np.stack(x), jnp.float32) for x in (o, m, l_sum))
    sink = rng.normal(size=3)
    for sinks in (None, sink):
        extra = 0.0 if sinks is None else np.exp(sinks)[:, None]
        weights = np.exp(scores) / (np.exp(scores).sum(1, keepdims=True) + extra)
        got = rd.combine_splits(o, m, l_sum, None if sinks is None else jnp.asarray(sinks, jnp.float32),
                                normalised=normalised)
        np.testing.assert_allclose(np.asarray(got), weights @ values, rtol=2e-5, atol=2e-6)
