"""benchmarks/packing.py: the layout figures it prints are the layouts the trainer packs with, and its timed part
runs Trainer.update under both rules at toy size."""

import pytest

from areal_jax.testing.processes import run_benchmark
from areal_jax.testing.scripts import load_script


def load_benchmark():
    return load_script("benchmarks/packing.py")


def test_layout_figures_against_the_rule_before():
    bench = load_benchmark()
    report = bench.main(["--skip-time", "--updates", "3"])
    assert set(report["layouts"]) == {"issue", "gsm8k", "reasoning", "default"}
    for figs in report["layouts"].values():
        for rule in ("previous", "cheapest", "now"):
            f = figs[rule]
            assert 0 < f["real_share"] <= 1 and f["micro_steps"] >= 1 and f["shapes"] >= 1
        assert figs["positions_ratio"] == pytest.approx(figs["previous"]["positions"] / figs["now"]["positions"])
    for name, figs in report["layouts"].items():  # each compile as 10.3 micro-steps of every device's budget
        w = bench.WORKLOADS[name]
        for f in (figs[rule] for rule in ("previous", "cheapest", "now")):
            assert f["with_compiles"] == pytest.approx(f["positions"] + f["shapes"] * 10.3 * w["budget"] * w["devices"])
    # A GSM8K-sized minibatch is a little more than one micro-step of 4 devices: the rule before paid for a second,
    # mostly empty one.
    gsm8k = report["layouts"]["gsm8k"]
    assert gsm8k["previous"]["real_share"] < 0.8 < 0.9 < gsm8k["cheapest"]["real_share"]
    # The trainer's default book of compiled shapes packs it in fewer shapes, at some padding, still far fuller than
    # the rule before.
    assert gsm8k["now"]["shapes"] < gsm8k["cheapest"]["shapes"]
    assert gsm8k["previous"]["real_share"] < 0.8 < gsm8k["now"]["real_share"] <= gsm8k["cheapest"]["real_share"]


def test_previous_rule_is_restored_and_reproduces_the_power_of_two_rows():
    bench = load_benchmark()
    from areal_jax.trainer import batch, layout

    counts, pack = layout.row_counts, batch.step_layout
    with bench.previous_rule():
        # 68,000 tokens in rows of 3,072 on 4 devices need 6 rows each; the budget holds 5.
        assert layout.row_counts(68_000, 3072, 4, 16384) == [5]
        assert layout.row_counts(1000, 256, 2, 1024) == [2]
    assert layout.row_counts is counts and batch.step_layout is pack
    assert layout.row_counts(68_000, 3072, 4, 16384) == [1, 2, 4, 5]


@pytest.mark.long  # 26-30 s in CI; the layout figures above and tests/test_rl_packing.py check the rule itself
def test_timed_update_at_toy_size():
    line, _ = run_benchmark("packing.py", "--updates", "1", "--time-budget", "256", "--repeats", "1", devices=4)
    timed = line["timed"]
    assert timed["previous_tokens_per_s"] > 0 and timed["now_tokens_per_s"] > 0 and timed["budget"] == 256
    assert timed["ratio"] == pytest.approx(timed["now_tokens_per_s"] / timed["previous_tokens_per_s"])
    assert timed["device"].startswith("4 x ") and timed["matmul_peak_gflops"] > 0
