"""The pieced paged-attention kernel (models.paged_pieces): head widths that are not a power of two, read in
power-of-two pieces, in the Pallas interpreter against the gather path; latent attention's decode through it; and
its Triton lowering."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.config_checks import MLA
from areal_jax.models.paged_attention import (
    PagedKVCache,
    default_path,
    gather_attention,
    init_paged_cache,
    kernel_attention,
    paged_hidden,
)
from areal_jax.models.paged_pieces import pieced_paged_attention, pieces
from areal_jax.testing import models as testing


def test_pieces_cover_the_width_in_powers_of_two():
    assert pieces(576) == ((0, 512), (512, 64))
    assert pieces(96) == ((0, 64), (64, 32)) and pieces(80) == ((0, 64), (64, 16)) and pieces(128) == ((0, 128),)
    for width in range(16, 1025, 16):
        got = pieces(width)
        assert sum(n for _, n in got) == width and all(n & (n - 1) == 0 and n >= 16 for _, n in got)
        assert [s for s, _ in got] == list(np.cumsum([0] + [n for _, n in got])[:-1])
    with pytest.raises(ValueError, match="multiple of 16, got 200"):
        pieces(200)


@pytest.mark.parametrize("heads,kv,width,shared,splits,block", [
    (20, 1, 576, True, 2, 2),    # latent attention: one kv head, the keys serving as values, heads padded to 32
    (8, 2, 96, False, 4, 1),     # grouped queries (Phi-3's width)
    (4, 4, 80, False, 1, 8),     # one split, every page in one block
])
def test_kernel_equals_the_gather_path(heads, kv, width, shared, splits, block):
    b, n, ps, per_row = 6, 48, 4, 8
    rng = np.random.default_rng(width)
    k_pages = jnp.asarray(rng.normal(size=(kv, n, ps, width)), jnp.float32)
    v_pages = k_pages if shared else jnp.asarray(rng.normal(size=(kv, n, ps, width)), jnp.float32)
    table = jnp.asarray(rng.permutation(n)[: b * per_row].reshape(b, per_row), jnp.int32)
    positions = jnp.asarray([0, 3, 4, 31, 12, -1], jnp.int32)  # page starts and ends, the last position, none
    q = jnp.asarray(rng.normal(size=(b, 1, heads, width)), jnp.float32)
    want = np.asarray(gather_attention(q, PagedKVCache((k_pages,), (v_pages,)), 0, table, positions[:, None]))[:, 0]
    lengths = jnp.clip(positions + 1, 0, per_row * ps)
    got = pieced_paged_attention(q[:, 0] / math.sqrt(width), k_pages, v_pages, table, lengths, splits=splits,
                                 pages_per_block=block, interpret=True)
    assert got.shape == (b, heads, width)
    np.testing.assert_allclose(np.asarray(got)[:5], want[:5], atol=2e-5)
    assert not np.asarray(got)[5].any()  # no visible position: zeros
    # and through kernel_attention's GPU branch, which picks it for such widths
    through = kernel_attention(q, PagedKVCache((k_pages,), (v_pages,)), 0, table, positions[:, None], interpret=True,
                               platform="gpu")
    np.testing.assert_allclose(np.asarray(through)[:, 0], want, atol=2e-5)


def test_kernel_attention_pads_the_table_for_the_pieced_kernel_too():
    """Rows of 9 pages of 4 at width 96: blocks of 8 pages (96-wide tiles stay within TILE_ELEMENTS) in 2 splits over a
    table padded to 16 columns, equal to the gather path."""
    from areal_jax.models.paged_attention import gpu_tiling

    b, n, ps, per_row, kv, heads, width = 5, 60, 4, 9, 2, 8, 96
    assert gpu_tiling(b, kv, per_row, ps, 128) == (16, 2, 8)
    rng = np.random.default_rng(7)
    k_pages, v_pages = (jnp.asarray(rng.normal(size=(kv, n, ps, width)), jnp.float32) for _ in range(2))
    table = jnp.asarray(rng.permutation(n)[: b * per_row].reshape(b, per_row), jnp.int32)
    positions = jnp.asarray([[0], [31], [32], [35], [17]], jnp.int32)  # both sides of the 8-page block's end
    q = jnp.asarray(rng.normal(size=(b, 1, heads, width)), jnp.float32)
    cache = PagedKVCache((k_pages,), (v_pages,))
    want = np.asarray(gather_attention(q, cache, 0, table, positions))
    got = kernel_attention(q, cache, 0, table, positions, interpret=True, platform="gpu")
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.long  # (excluded from the default run: `-m long`; 29-34 s. The kernel against the gather path at the
# op level runs in CI: the tests above)
def test_latent_attention_decodes_through_the_kernel():
    """A DeepSeek-V3 layer stack (cache width 32 + 16 = 48) prefilled into pages, then one decode step per row on the
    kernel path (GPU kernel, interpreted) and on the gather path: equal logits, equal to the full forward's."""
    cfg = testing.tiny_config("deepseek_v3", head_dim=28, mla=MLA(24, 32, 12, 16, 10))
    model = testing.random_model(cfg, seed=3)
    assert default_path(48, "gpu") == "gather" == default_path(48, "cpu")  # the kernel on request until measured
    seqs = np.random.default_rng(4).integers(3, cfg.vocab_size, (2, 14)).astype(np.int32)
    prompt, ps = 13, 4
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    cache = init_paged_cache(cfg, 8, ps)
    positions = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (2, prompt))
    _, cache = paged_hidden(model, jnp.asarray(seqs[:, :prompt]), positions, cache, table, path="gather")
    step = jnp.full((2, 1), prompt, jnp.int32)
    outs = {}
    for path in ("gather", "kernel"):
        h, _ = paged_hidden(model, jnp.asarray(seqs[:, prompt:]), step, cache, table, path=path, interpret=True,
                            platform="gpu")
        outs[path] = np.asarray(model.unembed(h))[:, 0]
    full = np.asarray(model(jnp.asarray(seqs)))[:, prompt]
    np.testing.assert_allclose(outs["kernel"], outs["gather"], atol=1e-5)
    np.testing.assert_allclose(outs["kernel"], full, atol=1e-4)


def test_lowers_for_cuda_at_deepseeks_width():
    """The kernel lowers to one Triton call at DeepSeek's cache width (576) in bf16, the pages read in place."""
    from jax import export

    b, h, width, n, ps, per_row = 8, 16, 576, 64, 16, 8
    shapes = [jax.ShapeDtypeStruct((b, h, width), jnp.bfloat16)] + \
        [jax.ShapeDtypeStruct((1, n, ps, width), jnp.bfloat16)] * 2 + \
        [jax.ShapeDtypeStruct((b, per_row), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(jax.jit(lambda *a: pieced_paged_attention(*a)), platforms=["cuda"],
                         disabled_checks=checks)(*shapes).mlir_module()
    assert text.count("@__gpu$xla.gpu.triton") == 1
    assert f"{b}x{per_row * ps}x" not in text  # no gathered [rows, positions, ...] view of the pages
