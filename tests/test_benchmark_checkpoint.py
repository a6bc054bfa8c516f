"""benchmarks/checkpoint.py at the tiny preset: both modes run in their own processes, every save they time is on
disk at the end, and the figures it prints are the ones its runs measured."""
import pytest

from areal_jax.testing.scripts import load_script


@pytest.mark.long  # 31-39 s in CI; tests/test_checkpoint_async.py checks the background save itself
def test_checkpoint_benchmark_runs_both_modes_and_keeps_every_save(tmp_path):
    bench = load_script("benchmarks/checkpoint.py")
    out = bench.main(["--updates", "4", "--every", "2", "--dir", str(tmp_path), "--rounds", "1"])
    runs = out["runs"]
    assert [r["mode"] for r in runs.values()] == ["sync", "async"]
    for r in runs.values():
        assert "failed" not in r, r
        assert r["steps_on_disk"] == [5, 7]  # 3 untimed updates (compile, update time), then saves after 2 and 4
        assert len(r["held_s"]) == len(r["write_s"]) == 2
        if r["mode"] == "sync":  # the trainer waited for each write: held at least as long as it took
            assert all(h >= w for h, w in zip(r["held_s"], r["write_s"]))
        assert r["state_bytes"] == runs["sync0"]["state_bytes"] > 0
    held = [h for r in runs.values() if r["mode"] == "async" for h in r["held_s"]]
    assert out["held_async_s"] == pytest.approx(sum(held) / len(held))
    assert out["held_ratio"] == pytest.approx(out["held_sync_s"] / out["held_async_s"])
