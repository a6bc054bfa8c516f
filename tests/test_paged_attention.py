"""Paged KV cache against the dense cache: attention paths, the model's decode path, freed and shared pages."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.cache_attention import cached_attention
from areal_jax.models.paged_attention import (
    PagedKVCache,
    copy_pages,
    default_path,
    gather_attention,
    gpu_tiling,
    init_paged_cache,
    kernel_attention,
    paged_hidden,
)
from areal_jax.sampler.pages import OutOfPages, PageAllocator
from areal_jax.testing import models as testing

L, KV, H, DH, PS = 2, 2, 4, 16, 4


def random_pages(b, s, num_pages, seed=0):
    """A dense cache [L, B, S, K, Dh], a shuffled page table [B, S / PS] and the same keys / values in pages;
    every other page of the pool holds junk far larger than the real entries."""
    rng = np.random.default_rng(seed)
    dense_k = rng.normal(size=(L, b, s, KV, DH)).astype(np.float32)
    dense_v = rng.normal(size=(L, b, s, KV, DH)).astype(np.float32)
    per_row = s // PS
    table = rng.permutation(num_pages)[: b * per_row].reshape(b, per_row).astype(np.int32)
    pk = np.full((L, KV, num_pages, PS, DH), 1e3, np.float32)
    pv = np.full((L, KV, num_pages, PS, DH), -1e3, np.float32)
    for row in range(b):
        for j in range(per_row):
            pk[:, :, table[row, j]] = dense_k[:, row, j * PS:(j + 1) * PS].transpose(0, 2, 1, 3)
            pv[:, :, table[row, j]] = dense_v[:, row, j * PS:(j + 1) * PS].transpose(0, 2, 1, 3)
    return (jnp.asarray(dense_k), jnp.asarray(dense_v)), table, PagedKVCache(tuple(jnp.asarray(x) for x in pk),
                                                                               tuple(jnp.asarray(x) for x in pv))


# positions at the start, end and middle of pages, and the last position of the cache
POSITIONS = np.array([0, 3, 4, 13, 31, 17], np.int32)


def test_gather_and_kernel_attention_equal_dense_cache_attention():
    b, s = len(POSITIONS), 32
    (dk, dv), table, paged = random_pages(b, s, num_pages=64)
    # Rows only own the pages up to their position (partially filled last page); the rest of the table is empty.
    owned = np.where(np.arange(table.shape[1])[None] <= (POSITIONS // PS)[:, None], table, -1)
    q = jax.random.normal(jax.random.key(1), (b, 1, H, DH), jnp.float32)
    positions = jnp.asarray(POSITIONS)[:, None]
    for layer in range(L):
        want = np.asarray(cached_attention(q, dk[layer], dv[layer], positions))
        got = np.asarray(gather_attention(q, paged, layer, jnp.asarray(owned), positions))
        np.testing.assert_allclose(got, want, atol=2e-5)
        got = np.asarray(kernel_attention(q, paged, layer, jnp.asarray(owned), positions, interpret=True))
        np.testing.assert_allclose(got, want, atol=2e-5)
    # several queries per row (prefill-like), across a page boundary
    q3 = jax.random.normal(jax.random.key(2), (b, 3, H, DH), jnp.float32)
    pos3 = jnp.asarray(np.maximum(POSITIONS[:, None] - np.array([2, 1, 0]), 0))
    np.testing.assert_allclose(np.asarray(gather_attention(q3, paged, 1, jnp.asarray(table), pos3)),
                               np.asarray(cached_attention(q3, dk[1], dv[1], pos3)), atol=2e-5)


def test_gpu_kernel_tiling_pads_the_table_to_whole_blocks_and_splits():
    # the sampler's usual table (1,152 positions in pages of 16) read 128 positions a block, not one page
    assert gpu_tiling(256, 2, 72, 16) == (80, 2, 8)
    assert gpu_tiling(8, 2, 1024, 16) == (1024, 16, 8)  # few rows: the most splits
    for rows in (1, 6, 64, 512):
        for per_row in (1, 3, 8, 9, 72, 100, 1025):
            for page_size in (1, 4, 16, 64, 256):
                width, splits, block = gpu_tiling(rows, 2, per_row, page_size)
                assert width % (splits * block) == 0 and per_row <= width < per_row + splits * block
                assert splits & (splits - 1) == 0 and block & (block - 1) == 0 and splits <= 16
                assert block * page_size <= max(128, page_size) and block <= per_row
                assert splits * block <= width and (splits == 1 or rows * 2 * splits <= 2048)


def test_gpu_kernel_with_a_padded_table_equals_dense_cache_attention():
    """Rows of 9 pages: the GPU kernel reads 2 splits of one 8-page block over a table padded to 16 columns."""
    positions = np.array([0, 3, 31, 32, 35, 20], np.int32)
    b, s = len(positions), 36
    (dk, dv), table, paged = random_pages(b, s, num_pages=80, seed=5)
    assert gpu_tiling(b, KV, s // PS, PS) == (16, 2, 8)
    owned = np.where(np.arange(table.shape[1])[None] <= (positions // PS)[:, None], table, -1)
    q = jax.random.normal(jax.random.key(4), (b, 1, H, DH), jnp.float32)
    pos = jnp.asarray(positions)[:, None]
    got = np.asarray(kernel_attention(q, paged, 0, jnp.asarray(owned), pos, interpret=True, platform="gpu"))
    np.testing.assert_allclose(got, np.asarray(cached_attention(q, dk[0], dv[0], pos)), atol=2e-5)


def test_kernel_attention_on_a_tensor_mesh_runs_per_head_shard_and_equals_dense():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tensor"))
    b, s = len(POSITIONS), 32
    (dk, dv), table, paged = random_pages(b, s, num_pages=64)
    split = NamedSharding(mesh, PartitionSpec("tensor", None, None, None))
    paged = PagedKVCache(tuple(jax.device_put(x, split) for x in paged.k), tuple(jax.device_put(x, split) for x in paged.v))
    q = jax.random.normal(jax.random.key(3), (b, 1, H, DH), jnp.float32)
    positions = jnp.asarray(POSITIONS)[:, None]

    def attend(q, paged):
        return kernel_attention(q, paged, 1, jnp.asarray(table), positions, interpret=True, mesh=mesh)

    eqns = [e.primitive.name for e in jax.make_jaxpr(attend)(q, paged).jaxpr.eqns]
    assert "shard_map" in eqns  # each device runs the kernel on its own kv heads' pages
    got = np.asarray(jax.jit(attend)(q, paged))
    np.testing.assert_allclose(got, np.asarray(cached_attention(q, dk[1], dv[1], positions)), atol=2e-5)


def test_tpu_kernel_attention_equals_dense_cache_attention():
    """JAX's Pallas TPU paged-attention kernel (interpreted) against the dense cache: rows at page starts, ends and
    middles, an empty row (position -1: zeros), junk in every page a row does not own. The kernel multiplies at
    the TPU's default (bf16) precision, so the cache and queries are bf16 and the reference is float32."""
    kv, h, dh, ps, per_row, num_pages = 2, 4, 128, 8, 4, 40
    positions = np.array([0, 7, 8, 19, 31, -1], np.int32)
    b, s = len(positions), per_row * ps
    rng = np.random.default_rng(3)
    dense_k, dense_v = (rng.normal(size=(b, s, kv, dh)).astype(np.float32) for _ in range(2))
    table = rng.permutation(num_pages)[: b * per_row].reshape(b, per_row).astype(np.int32)
    pk, pv = np.full((kv, num_pages, ps, dh), 30.0, np.float32), np.full((kv, num_pages, ps, dh), -30.0, np.float32)
    for row in range(b):
        for j in range(per_row):
            pk[:, table[row, j]] = dense_k[row, j * ps:(j + 1) * ps].transpose(1, 0, 2)
            pv[:, table[row, j]] = dense_v[row, j * ps:(j + 1) * ps].transpose(1, 0, 2)
    owned = np.where(np.arange(per_row)[None] <= (positions // ps)[:, None], table, -1)
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    paged = PagedKVCache((bf16(pk),), (bf16(pv),))
    q = bf16(rng.normal(size=(b, 1, h, dh)))
    pos = jnp.asarray(positions)[:, None]
    f32 = lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    want = np.asarray(cached_attention(q.astype(jnp.float32), f32(dense_k), f32(dense_v), pos))
    got = np.asarray(kernel_attention(q, paged, 0, jnp.asarray(owned), pos, interpret=True, platform="tpu"))
    assert got.dtype == np.dtype(jnp.bfloat16) and got.shape == (b, 1, h, dh)
    np.testing.assert_allclose(got.astype(np.float32), want, atol=3e-2, rtol=3e-2)
    assert not np.any(np.asarray(got[-1], np.float32))  # the empty row
    # The same queries through the GPU kernel agree with it too.
    gpu = np.asarray(kernel_attention(q, paged, 0, jnp.asarray(owned), pos, interpret=True, platform="gpu"))
    np.testing.assert_allclose(gpu.astype(np.float32), want, atol=3e-2, rtol=3e-2)


def test_tpu_kernel_needs_head_dim_a_multiple_of_128_and_the_default_path_knows():
    paged = init_paged_cache(testing.tiny_config(), num_pages=8, page_size=PS)  # head_dim 16
    q = jnp.zeros((2, 1, H, DH), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 128.*gather"):
        kernel_attention(q, paged, 0, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                         interpret=True, platform="tpu")
    assert default_path(64, "gpu") == "kernel" and default_path(128, "tpu") == "kernel"
    assert default_path(64, "tpu") == "gather" and default_path(128, "cpu") == "gather"


@pytest.fixture(scope="module")
def model():
    # YaRN RoPE past a pretraining length of 8 (cos and sin scaled): the paged path rotates as the dense one does
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    return testing.random_model(testing.tiny_config("qwen2", num_layers=L, rope_scaling=yarn), seed=0)


_JITTED = {}


def dense_logits(model, seq, pad_to=64):
    """Logits at every position of ``seq`` from a plain forward pass (no cache; tail padding is invisible)."""
    graphdef, params = nnx.split(model)
    if "dense" not in _JITTED:
        _JITTED["dense"] = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[0])
    padded = np.zeros((1, pad_to), np.int32)
    padded[0, : len(seq)] = seq
    return np.asarray(_JITTED["dense"](params, padded))[: len(seq)]


def run_paged(model, cache, table, slot_rows, tokens, positions, path="gather"):
    """One jitted paged forward of tokens [B, T] at positions [B, T] for the given rows of the page table."""
    graphdef, params = nnx.split(model)
    if path not in _JITTED:
        def forward(params, cache, table, tokens, positions):
            m = nnx.merge(graphdef, params)
            h, cache = paged_hidden(m, tokens, positions, cache, table, path=path, interpret=True)
            return m.unembed(h), cache
        _JITTED[path] = jax.jit(forward)
    logits, cache = _JITTED[path](params, cache, jnp.asarray(table[slot_rows]), jnp.asarray(tokens, jnp.int32),
                                  jnp.asarray(positions, jnp.int32))
    return np.asarray(logits), cache


def test_decode_over_pages_equals_dense_with_freed_and_reused_pages(model):
    cfg = model.cfg
    alloc = PageAllocator(num_pages=5, page_size=PS, num_slots=2, pages_per_slot=6)
    cache = init_paged_cache(cfg, 5, PS)
    rng = np.random.default_rng(0)
    for request in range(3):  # later requests reuse pages an earlier one wrote (freed, then taken again)
        prompt = rng.integers(3, cfg.vocab_size, size=(3, 6, 3)[request]).tolist()
        alloc.ensure(0, len(prompt))
        logits, cache = run_paged(model, cache, alloc.table, [0], [prompt], [list(range(len(prompt)))])
        seq = list(prompt)
        for step in range(9):  # greedy decode one token at a time, crossing page boundaries
            tok = int(np.argmax(logits[0, -1]))
            np.testing.assert_allclose(logits[0, -1], dense_logits(model, seq)[-1], atol=1e-4)
            seq.append(tok)
            alloc.ensure(0, len(seq))
            logits, cache = run_paged(model, cache, alloc.table, [0], [[tok]], [[len(seq) - 1]],
                                      path="kernel" if step in (3, 4) else "gather")
        np.testing.assert_allclose(logits[0, -1], dense_logits(model, seq)[-1], atol=1e-4)
        assert alloc.free_pages == 5 - alloc.pages_for(len(seq))
        alloc.release(0)
        assert alloc.free_pages == 5
    with pytest.raises(OutOfPages, match="more KV pages"):
        alloc.ensure(1, 6 * PS)  # 6 pages do not fit a pool of 5, and nothing is taken
    assert alloc.free_pages == 5


def test_group_samples_share_full_prompt_pages_and_copy_the_partial_one(model):
    cfg = model.cfg
    alloc = PageAllocator(num_pages=12, page_size=PS, num_slots=3, pages_per_slot=5)
    cache = init_paged_cache(cfg, 12, PS)
    prompt = [5, 9, 13, 17, 21, 25]  # one full page and a partial one
    alloc.ensure(0, len(prompt))
    logits, cache = run_paged(model, cache, alloc.table, [0], [prompt], [list(range(len(prompt)))])
    copies = alloc.share_prefix(0, [0, 1, 2], len(prompt))
    assert len(copies) == 2 and alloc.table[1, 0] == alloc.table[2, 0] == alloc.table[0, 0]
    assert alloc.refcount[alloc.table[0, 0]] == 3 and len({alloc.table[s, 1] for s in range(3)}) == 3
    cache = copy_pages(cache, jnp.asarray([c.src for c in copies]), jnp.asarray([c.dst for c in copies]))
    seqs = [list(prompt) for _ in range(3)]
    first = [int(np.argsort(logits[0, -1])[-1 - s]) for s in range(3)]  # three different first tokens
    tokens = first
    for step in range(7):
        for s in range(3):
            seqs[s].append(tokens[s])
            alloc.ensure(s, len(seqs[s]))
        logits, cache = run_paged(model, cache, alloc.table, [0, 1, 2], [[t] for t in tokens],
                                  [[len(q) - 1] for q in seqs])
        for s in range(3):
            np.testing.assert_allclose(logits[s, -1], dense_logits(model, seqs[s])[-1], atol=1e-4)
        tokens = [int(np.argmax(logits[s, -1])) for s in range(3)]
    shared = int(alloc.table[0, 0])
    for s in range(3):
        alloc.release(s)
    assert alloc.refcount[shared] == 0 and alloc.free_pages == 12
