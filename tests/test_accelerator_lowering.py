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


@pytest.mark.parametrize("rows,heads,head_dim,max_len,softcap,grid", [
    (256, (14, 2), 64, 1152, None, ("256", "2", "1")),  # Qwen2.5-0.5B at 256 slots: one split
    (64, (12, 2), 128, 16384, None, ("64", "2", "4")),  # 1.5B's heads at 16k positions: four splits
    (8, (8, 4), 256, 8192, 50.0, ("8", "4", "16"))])  # Gemma 2's width and score cap
def test_ragged_dense_decode_attention_lowers_for_triton(rows, heads, head_dim, max_len, softcap, grid):
    import re

    from areal_jax.models.ragged_decode import decode_attention

    (h, kv) = heads

    def attend(q, k, v, positions):
        return decode_attention(q, k, v, positions, softcap=softcap, interpret=False)

    text = lowered(attend, "cuda", spec((rows, 1, h, head_dim)), spec((rows, max_len, kv, head_dim)),
                   spec((rows, max_len, kv, head_dim)), spec((rows, 1), jnp.int32))
    assert f"@{TRITON}" in text
    assert re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text) == [grid]
    assert "stablehlo.gather" not in text and "stablehlo.transpose" not in text  # the cache is read in place


def test_the_engines_decode_dispatch_with_the_ragged_kernel_lowers_for_cuda(monkeypatch):
    """The sampler's k-step dispatch at Qwen2.5-0.5B's attention widths (2 layers), traced as on a GPU: with
    decode_attention="kernel" its attention is the Triton call and no XLA product reads the [256, 1152] cache, which
    the XLA path's four (keys and values, two layers) do."""
    import re

    from flax import nnx

    from areal_jax.models import Transformer
    from areal_jax.sampler.engine import Engine
    from areal_jax.testing.models import tiny_config

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # trace as the GPU would (no interpreter)
    cfg = tiny_config("qwen2", hidden_size=896, num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=256,
                      dtype=jnp.bfloat16, max_position_embeddings=4096)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    _, params = nnx.split(model)
    cache_products = {}
    for path in ("xla", "kernel"):
        engine = Engine(model, num_slots=256, max_len=1152, decode_attention=path)
        exported = export.export(engine._jit_generate_steps, platforms=["cuda"],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])
        text = exported(params, jax.eval_shape(engine._init_fn), spec((4, 2), jnp.uint32)).mlir_module()
        assert (f"@{TRITON}" in text) == (path == "kernel")
        cache_products[path] = len(re.findall(r"stablehlo.dot_general[^\n]*256x1152", text))
    assert cache_products == {"xla": 4, "kernel": 0}


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


def test_on_a_mesh_the_kernels_lower_on_each_devices_share(monkeypatch):
    """Under a 2 x 2 (fsdp x tensor) mesh context the flash kernel's Triton grid covers a device's rows and heads, and
    the experts' kernels a device's tokens and width slice (a kernel XLA cannot partition would otherwise get the
    whole batch: models.sharding)."""
    import re

    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from areal_jax.models.moe import MoE
    from areal_jax.models.packed_attention import per_shard
    from areal_jax.testing.models import tiny_config

    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    checks = [export.DisabledSafetyCheck.custom_call(TRITON)]

    def attend(q, k, v, seg):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return per_shard(lambda q, k, v, s: flash_attention(q, k, v, s, interpret=False), seg)(q, k, v)

    heads = NamedSharding(mesh, PartitionSpec("fsdp", None, "tensor", None))
    rows = NamedSharding(mesh, PartitionSpec("fsdp", None))
    text = export.export(jax.jit(attend, in_shardings=(heads, heads, heads, rows)), platforms=["cuda"],
                         disabled_checks=checks)(spec((4, 2048, 14, 64)), spec((4, 2048, 2, 64)),
                                                 spec((4, 2048, 2, 64)), spec((4, 2048), jnp.int32)).mlir_module()
    grids = re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)
    assert ("32", "2", "7") in grids  # 2,048 / 64 query blocks, 4 / 2 rows, 14 / 2 heads

    import functools

    from areal_jax.models import expert_paths
    from areal_jax.models.grouped_matmul import grouped_matmul

    monkeypatch.setattr(expert_paths, "grouped_matmul", functools.partial(grouped_matmul, interpret=False))  # the GPU's kernel
    def grids(expert_parallel):
        cfg = tiny_config("qwen3_moe", hidden_size=256, moe_intermediate_size=256, moe_impl="pallas",
                          dtype=jnp.bfloat16, expert_parallel=expert_parallel)
        graphdef, state = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))

        def experts(st, x):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return nnx.merge(graphdef, st)(x)

        text = export.export(jax.jit(experts, in_shardings=(None, NamedSharding(mesh, PartitionSpec("fsdp", None,
                                                                                                      None)))),
                             platforms=["cuda"], disabled_checks=checks)(state, spec((4, 256, 256))).mlir_module()
        return sorted(set(re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32", text)))

    # FSDP: a device's 512 tokens x top 2 = 1,024 pairs in blocks of 128, with at most 4 experts x 127 padding rows:
    # 12 blocks (the whole batch would take 20); its 128 of the width in one tile (gate, up: the whole width would
    # take 2), and the hidden 256 in two (down)
    assert grids(False) == [("12", "1"), ("12", "2")]
    # expert parallel: both row shards' 1,024 tokens x 2 pairs, padding for this device's 2 experts and the group of
    # the others' pairs (skipped by the kernel): 19 blocks; the same width tiles
    assert grids(True) == [("19", "1"), ("19", "2")]


def test_on_a_mesh_splash_lowers_for_tpu_on_each_devices_share():
    """The TPU's packed-attention kernel under a 2 x 2 (fsdp x tensor) mesh context: the Mosaic call in the
    exported program takes one device's rows and heads (2 of 4 rows, 7 of 14 heads), never the whole batch."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from areal_jax.models.packed_attention import per_shard

    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)

    def attend(q, k, v, seg):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return per_shard(lambda q, k, v, s: splash_attention(q, k, v, s, interpret=False), seg)(q, k, v)

    heads = NamedSharding(mesh, PartitionSpec("fsdp", None, "tensor", None))
    rows = NamedSharding(mesh, PartitionSpec("fsdp", None))
    text = export.export(jax.jit(attend, in_shardings=(heads, heads, heads, rows)), platforms=["tpu"])(
        spec((4, 2048, 14, 64)), spec((4, 2048, 2, 64)), spec((4, 2048, 2, 64)), spec((4, 2048), jnp.int32)).mlir_module()
    calls = [line for line in text.splitlines() if f"@{MOSAIC}(" in line]
    assert len(calls) == 1 and "tensor<2x7x2048x64xbf16>" in calls[0]  # [rows, heads, T, head_dim] of one device
    assert "14x2048x64" not in calls[0] and "4x7x2048" not in calls[0]
