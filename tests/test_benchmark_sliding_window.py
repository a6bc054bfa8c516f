"""benchmarks/sliding_window.py at toy size: every variant (whole context, window, ring) runs and agrees, the rings
hold the window's share of the cache, and its baseline really reads the whole
context (the switch it flips changes the compiled decode step)."""
import jax
import jax.numpy as jnp

from areal_jax.models import cache_attention
from areal_jax.testing.scripts import load_script


def test_the_benchmark_reports_both_caches_and_its_baseline_reads_everything():
    bench = load_script("benchmarks/sliding_window.py")
    report = bench.main(["--layers", "3", "--pattern", "3", "--window", "16", "--hidden", "32", "--heads", "2",
                         "--kv-heads", "1", "--head-dim", "16", "--vocab", "64", "--rows", "3", "--context", "128",
                         "--page-size", "8", "--repeats", "1"])
    assert report["sliding_layers"] == 2 and report["context"] == 128
    for cache in ("dense", "paged"):
        figures = report[cache]
        assert figures["max_logit_diff"] < 1e-3 and figures["window_ms"] > 0 and figures["whole_context_ms"] > 0
        assert figures["ring_max_logit_diff"] < 1e-3 and figures["ring_ms"] > 0
        # 2 sliding layers of 3 keep 16 of 128 positions: (1 * 128 + 2 * 16) / (3 * 128) of the cache
        assert abs(figures["ring_cache_mib"] / figures["cache_mib"] - 160 / 384) < 1e-9
    q = jax.ShapeDtypeStruct((2, 1, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 128, 1, 16), jnp.float32)
    pos = jax.ShapeDtypeStruct((2, 1), jnp.int32)

    def program():
        fn = jax.jit(lambda *a: cache_attention.cached_attention(*a, chunk_size=32, window=16, counted=True))
        return fn.lower(q, kv, kv, pos).as_text()

    windowed = program()
    with bench.whole_context_reads():
        whole = program()
    assert "tensor<2x16x1x16xf32>" in windowed and "while" not in windowed  # a 16-position gather per row
    assert "while" in whole and "tensor<2x16x1x16xf32>" not in whole  # the loop over every chunk of the cache
