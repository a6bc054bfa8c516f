"""The accelerator kernels lower for their real targets, checked on the CPU.

`jax.export` lowers a program for a platform the host does not have: Pallas kernels go through their real
lowering (Triton for "cuda", Mosaic for "tpu") instead of the interpreter the other tests run on the CPU.
A kernel whose block shapes, dtypes or ops a target rejects fails here, before it reaches a GPU or a TPU.
Shapes are the Qwen2.5 ones in bfloat16 (0.5B: 14 / 2 heads of 64; 1.5B: 12 / 2 heads of 128)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

from areal_jax.models.flash_attention import flash_attention
from areal_jax.models.paged_attention import PagedKVCache, kernel_attention
from areal_jax.models.splash import splash_attention

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"


def lowered(fn, platform: str, *shapes) -> str:
    """The StableHLO text of jit(fn) lowered for `platform` (Triton calls allowed: they have no stable ABI,
    which only matters for serialising, not for this check)."""
    checks = [export.DisabledSafetyCheck.custom_call(TRITON)]
    return export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*shapes).mlir_module()


def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("platform,heads,head_dim,window,softcap", [
    ("cuda", (14, 2), 64, None, None), ("cuda", (12, 2), 128, None, None), ("tpu", (14, 2), 64, None, None),
    ("tpu", (12, 2), 128, None, None),
    ("cuda", (4, 1), 256, 512, None), ("tpu", (4, 1), 256, 512, None),  # gemma-3-1b's heads and sliding window
    ("cuda", (8, 4), 256, 1024, 50.0), ("tpu", (8, 4), 256, 1024, 50.0)])  # gemma-2-2b's, with its score cap
def test_packed_flash_attention_forward_and_backward_lower(platform, heads, head_dim, window, softcap):
    (h, kv), t = heads, 2048
    attend = flash_attention if platform == "cuda" else splash_attention

    def loss(q, k, v, seg):
        return attend(q, k, v, seg, interpret=False, window=window, softcap=softcap).astype(jnp.float32).sum()

    shapes = (spec((2, t, h, head_dim)), spec((2, t, kv, head_dim)), spec((2, t, kv, head_dim)),
              spec((2, t), jnp.int32))
    text = lowered(jax.grad(loss, argnums=(0, 1, 2)), platform, *shapes)
    kernel = TRITON if platform == "cuda" else MOSAIC
    assert text.count(f"@{kernel}") >= 3  # the forward (recomputed for residuals) and the backward kernels
    assert f"{t}x{t}x" not in text  # no [.., T, T] tensor anywhere: memory linear in the row length


@pytest.mark.parametrize("platform,head_dim,softcap", [("cuda", 64, None), ("cuda", 128, None), ("tpu", 128, None),
                                                       ("cuda", 128, 50.0), ("tpu", 128, 50.0)])
def test_paged_decode_attention_lowers(platform, head_dim, softcap):
    rows, h, kv, page_size, per_row, pages = 256, 14, 2, 16, 80, 256 * 80

    def attend(q, k_pages, v_pages, table, positions):
        cache = PagedKVCache((k_pages,), (v_pages,))
        return kernel_attention(q, cache, 0, table, positions, platform="gpu" if platform == "cuda" else "tpu",
                                softcap=softcap)

    text = lowered(attend, platform, spec((rows, 1, h, head_dim)), spec((kv, pages, page_size, head_dim)),
                   spec((kv, pages, page_size, head_dim)), spec((rows, per_row), jnp.int32),
                   spec((rows, 1), jnp.int32))
    assert f"@{TRITON if platform == 'cuda' else MOSAIC}" in text
    assert "stablehlo.gather" not in text  # pages are read in place, never gathered into a copy


@pytest.mark.parametrize("experts,hidden,width,block", [
    (128, 2048, 768, 128),  # Qwen3-30B-A3B
    (40, 1536, 512, 64),  # granite-3.0-3b-a800m: a hidden size that is no power of two
    (8, 4096, 14336, 128)])  # Mixtral-8x7B
def test_grouped_matmul_forward_and_backward_lower_for_triton(experts, hidden, width, block):
    from areal_jax.models.grouped_matmul import grouped_matmul

    rows = 40 * block

    def loss(x, w, owner):
        return grouped_matmul(x, w, owner, block=block, out_dtype=jnp.float32, interpret=False).sum()

    text = lowered(jax.value_and_grad(loss, argnums=(0, 1)), "cuda", spec((rows, hidden)),
                   spec((experts, hidden, width)), spec((rows // block,), jnp.int32))
    assert text.count(f"@{TRITON}") >= 3  # the product, the input gradient and the weight gradient
    assert f"{rows}x{experts}x" not in text  # no expansion of the rows to every expert
