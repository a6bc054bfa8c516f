"""benchmarks/staleness_ablation.py at toy size: 2 etas x 2 losses x 1 seed of the tiny run, its table,
PNG and JSON line, resuming a half-finished sweep, and the statistics it reports."""
import json
import os
import shutil

import numpy as np
import pytest

from areal_jax.testing.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    return load_script("benchmarks/staleness_ablation.py")


@pytest.fixture(scope="module")
def tiny_config_file(tmp_path_factory):
    from areal_jax.testing.tiny import write_tiny_assets

    d = tmp_path_factory.mktemp("tiny")
    write_tiny_assets(str(d))
    path = d / "config.py"
    path.write_text(
        "from areal_jax.testing.tiny import tiny_config\n\n\n"
        "def get_config():\n"
        f"    c = tiny_config({str(d)!r}, write=False)\n"
        "    c.eval.max_new_tokens = 8\n"
        "    c.reward.fn = 'exact'\n"
        "    return c\n")
    return str(path)


@pytest.mark.long  # four subprocess runs of the tiny job (excluded from the default run: `-m long`)
def test_sweep_writes_table_png_json_and_resumes(tiny_config_file, tmp_path, capsys):
    bench = _load()
    argv = ["--config", tiny_config_file, "--etas", "0,1", "--losses", "decoupled,ppo", "--seeds", "1",
            "--steps", "2", "--n_test", "6", "--set", "train.lr=1e-3", "--out", str(tmp_path)]
    report = bench.main(argv)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["benchmark"] == "staleness_ablation"
    assert report["cells_run"] == 4 and len(report["rows"]) == 4
    for r in report["rows"]:
        assert r["seeds"] == 1 and r["greedy_std"] == 0.0
        assert 0 <= r["greedy_mean"] <= 1 and 0 <= r["sampled_mean"] <= 1
        assert r["staleness_max"] <= int(r["eta"])  # the bound held in every cell
        assert r["trained_tokens_per_s"] > 0 and r["wall_s"] > 0
    for name, cell in report["cells"].items():
        cfg = json.load(open(tmp_path / "cells" / name / "config.json"))
        loss, eta = name.split("_")[0], int(name.split("_eta")[1].split("_")[0])
        assert cfg["train"]["loss"] == loss and cfg["rollout"]["max_staleness"] == eta and cfg["total_steps"] == 2
        assert cfg["train"]["lr"] == 1e-3 and cell["n_test"] == 6
    table = (tmp_path / "table.md").read_text()
    assert "| 0 | 42.0 | 42.0 |" in table and "| 1 | 41.8 | 42.1 |" in table
    assert (tmp_path / "accuracy_vs_eta.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resume: finished cells are skipped; a cell without cell.json (killed midway) is run again.
    calls = []
    bench.run_cell = lambda config, overrides, run_dir: calls.append(run_dir)
    again = bench.main(argv)
    assert calls == [] and again["cells_run"] == 0 and again["rows"] == report["rows"]

    # A sweep stopped mid-way (a time limit) still leaves the figures of every cell it finished.
    os.remove(tmp_path / "results.json")
    for name in ("decoupled_eta1_seed0", "ppo_eta1_seed0"):
        os.remove(tmp_path / "cells" / name / "cell.json")  # the run directories stay: read_cell reads them

    def stopped_at_the_last_cell(config, overrides, run_dir):
        if run_dir.endswith("ppo_eta1_seed0"):
            raise KeyboardInterrupt
    bench.run_cell = stopped_at_the_last_cell
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    saved = json.load(open(tmp_path / "results.json"))
    assert sorted(saved["cells"]) == ["decoupled_eta0_seed0", "decoupled_eta1_seed0", "ppo_eta0_seed0"]
    assert saved["cells_run"] == 1 and len(saved["rows"]) == 3
    assert "| 1 |" in (tmp_path / "table.md").read_text()
    bench.run_cell = lambda config, overrides, run_dir: calls.append(run_dir)
    assert bench.main(argv)["cells_run"] == 1 and calls == [str(tmp_path / "cells" / "ppo_eta1_seed0")]
    calls.clear()
    os.remove(tmp_path / "cells" / "ppo_eta1_seed0" / "cell.json")
    with pytest.raises(FileNotFoundError):  # the stand-in runner wrote nothing, so reading the run fails
        shutil.rmtree(tmp_path / "cells" / "ppo_eta1_seed0")
        bench.main(argv)
    assert calls == [str(tmp_path / "cells" / "ppo_eta1_seed0")]
    # --report_only runs nothing and reports the finished cells (ppo_eta1_seed0 has none now).
    report_only = bench.main(argv + ["--report_only"])
    assert calls == [str(tmp_path / "cells" / "ppo_eta1_seed0")] and report_only["cells_run"] == 0
    assert sorted(report_only["cells"]) == ["decoupled_eta0_seed0", "decoupled_eta1_seed0", "ppo_eta0_seed0"]
    with pytest.raises(SystemExit, match="holds a sweep with other settings"):
        bench.main(argv[:-2] + ["--steps", "3", "--out", str(tmp_path)])


def test_aggregate_and_verdict_follow_the_hand_worked_numbers():
    bench = _load()
    cells = {}
    acc = {("ppo", 0): [0.60, 0.62, 0.64], ("ppo", 4): [0.40, 0.42, 0.44],
           ("decoupled", 0): [0.61, 0.63, 0.65], ("decoupled", 4): [0.60, 0.58, 0.62]}
    for (loss, eta), vals in acc.items():
        for s, v in enumerate(vals):
            cells[(eta, loss, s)] = {"greedy": v, "sampled": v / 2, "wall_s": 10.0 + eta, "trained_tokens_per_s": 5.0,
                                     "staleness_hist": {"0": 3, str(eta): 1}}
    rows = bench.aggregate(cells, [0, 4], ["decoupled", "ppo"], [0, 1, 2])
    ppo4 = next(r for r in rows if r["eta"] == "4" and r["loss"] == "ppo")
    assert ppo4["greedy_mean"] == pytest.approx(0.42) and ppo4["greedy_std"] == pytest.approx(0.02)
    assert ppo4["staleness_hist"] == {"0": 9, "4": 3} and ppo4["staleness_mean"] == pytest.approx(1.0)
    v = bench.verdict(rows)
    # PPO: 0.62 -> 0.42, drop 0.20 > 2 x 0.02; decoupled: 0.63 -> 0.60, drop 0.03 < 0.10.
    assert v["ppo_degrades"] and v["at_eta"] == "4" and v["decoupled_holds"]
    assert v["per_eta"][0]["ppo_drop"] == pytest.approx(0.20) and v["per_eta"][0]["decoupled_drop"] == pytest.approx(0.03)
    assert bench.mean_std([0.5]) == (0.5, 0.0) and bench.mean_std([None]) == (None, None)
    assert np.isclose(bench.mean_std([1.0, 2.0, 4.0])[1], np.std([1, 2, 4], ddof=1))
