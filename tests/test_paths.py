"""The path layer (areal_jax.paths): local paths, file:// URLs and object stores behind one interface.

The object store is areal_jax.testing.fake_store: `fake-gs://` URLs kept in a temporary directory, which
refuses what object stores cannot do (appending to an object), so a writer that only works on a local
disk fails here. The slow test runs the tiny job and its resume on the fake store and on a file:// URL
and compares the trajectory records.
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax import config as config_lib
from areal_jax import paths
from areal_jax.testing import fake_store


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh fake object store; node-local scratch space under tmp_path too."""
    root = tmp_path / "store"
    monkeypatch.setenv("AREAL_FAKE_STORE_ROOT", str(root))
    monkeypatch.setenv(paths.ENV_SCRATCH, str(tmp_path / "scratch"))
    fake_store.register(str(root))
    return root


def test_run_path_forms(tmp_path):
    assert os.fspath(paths.run_path(f"file://{tmp_path}/run")) == f"{tmp_path}/run"
    assert os.fspath(paths.run_path("file:///a%20b/c")) == "/a b/c"
    assert paths.is_local(f"file://{tmp_path}") and paths.is_local("runs/x")
    assert paths.local_path(f"file://{tmp_path}/x") == f"{tmp_path}/x"
    gs = paths.run_path("gs://bucket/runs/math")
    assert os.fspath(gs / "metrics.jsonl") == "gs://bucket/runs/math/metrics.jsonl"
    assert not paths.is_local(gs) and paths.local_path(gs) is None
    with pytest.raises(ValueError, match=r"s9://.*--config\.run_dir="):
        paths.run_path("s9://bucket/x")
    with pytest.raises(ValueError, match="must be local"):
        paths.run_path("file://otherhost/x")


def test_fake_store_behaves_like_an_object_store(store):
    p = paths.run_path("fake-gs://bucket/run/a.txt")
    assert type(p).__name__ == "FakeStorePath" and str(p) == "fake-gs://bucket/run/a.txt"
    with p.open("w") as f:
        f.write("partial")
        assert not p.exists()  # an object appears only when its upload completes
    assert p.read_text() == "partial" and (store / "bucket" / "run" / "a.txt").read_text() == "partial"
    with pytest.raises(OSError, match="cannot append"):
        p.open("a")


@pytest.mark.parametrize("where", ["local", "file_url", "store"])
def test_append_file_keeps_every_line_and_resumes(tmp_path, store, where):
    base = {"local": str(tmp_path / "d"), "file_url": f"file://{tmp_path}/d", "store": "fake-gs://bucket/d"}[where]
    target = paths.join(base, "log.jsonl")
    log = paths.AppendFile(target, sync_interval_s=3600)
    log.write("1\n")
    log.write("2\n")
    # Locally every write is on disk at once; an object store sees the lines at the next sync.
    assert paths.exists(target) == (where != "store")
    log.sync()
    assert paths.read_text(target) == "1\n2\n"
    log.close()
    again = paths.AppendFile(target, sync_interval_s=3600)  # a resumed run continues the file
    again.write("3\n")
    assert again.read_text() == "1\n2\n3\n"
    again.rewrite("1\n")  # truncation (resume drops the steps that run again)
    again.write("4\n")
    again.close()
    assert paths.read_text(target) == "1\n4\n"


def test_append_file_syncs_on_its_interval(store):
    target = paths.run_path("fake-gs://bucket/d/log.jsonl")
    log = paths.AppendFile(target, sync_interval_s=0.0)
    log.write("a\n")
    assert target.read_text() == "a\n"
    log.close()


def test_atomic_open_leaves_the_old_file_on_error(tmp_path, store):
    for target in (tmp_path / "x.json", paths.run_path("fake-gs://bucket/x.json")):
        paths.write_json(target, {"v": 1})
        with pytest.raises(RuntimeError), paths.atomic_open(target) as f:
            f.write('{"v": ')
            raise RuntimeError("killed mid-write")
        assert paths.read_json(target) == {"v": 1}
    assert sorted(os.listdir(tmp_path)) == ["scratch", "store", "x.json"]  # no temporary left behind


def test_mirrored_dir_uploads_new_and_changed_files(store):
    mirror = paths.MirroredDir("fake-gs://bucket/tb")
    with open(os.path.join(mirror.local, "events.1"), "w") as f:
        f.write("a")
    os.makedirs(os.path.join(mirror.local, "sub"))
    with open(os.path.join(mirror.local, "sub", "events.2"), "w") as f:
        f.write("b")
    assert sorted(mirror.sync()) == ["events.1", os.path.join("sub", "events.2")]
    assert mirror.sync() == []  # nothing changed
    with open(os.path.join(mirror.local, "events.1"), "a") as f:
        f.write("c")
    assert mirror.sync() == ["events.1"]
    mirror.close()
    assert (store / "bucket" / "tb" / "events.1").read_text() == "ac"
    assert (store / "bucket" / "tb" / "sub" / "events.2").read_text() == "b"
    assert not os.path.exists(mirror.local)
    assert paths.MirroredDir(store / "local").local == str(store / "local")  # local: no copy at all


def test_checkpoint_directory(tmp_path, store):
    assert paths.checkpoint_directory("rel/ckpt") == os.path.abspath("rel/ckpt")
    assert paths.checkpoint_directory("gs://bucket/run/checkpoints") == "gs://bucket/run/checkpoints"
    assert paths.checkpoint_directory("fake-gs://bucket/run/checkpoints") == str(store / "bucket/run/checkpoints")
    with pytest.raises(ValueError, match="orbax"):
        paths.checkpoint_directory("s3://bucket/run")


def test_config_rejects_unusable_run_dirs():
    c = config_lib.base_config()
    c.run_dir = "s9://bucket/run"
    with pytest.raises(config_lib.ConfigError, match="run_dir"):
        config_lib.validate(c, check_paths=False)
    c.run_dir = "gs://bucket/run"
    config_lib.validate(c, check_paths=False)
    c.distributed.file_heartbeats = True
    with pytest.raises(config_lib.ConfigError, match="file_heartbeats"):
        config_lib.validate(c, check_paths=False)
    c.run_dir, c.distributed.heartbeat_timeout_s = "runs/x", 0.5
    with pytest.raises(config_lib.ConfigError, match="heartbeat_timeout_s"):
        config_lib.validate(c, check_paths=False)


def test_a_missing_object_store_client_is_one_sentence(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("gcsfs", "tensorflow") else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the gcsfs package .*pip install gcsfs"):
        paths.check_backend("gs://bucket/run")
    paths.check_backend("runs/x")  # local paths need nothing
    paths.check_backend("file:///tmp/x")
    c = config_lib.base_config()
    c.run_dir = "gs://bucket/run"
    with pytest.raises(config_lib.ConfigError, match=r"--config\.run_dir: .*gcsfs"):
        config_lib.validate(c)  # checked before the model and data paths


def test_metrics_and_timeline_on_the_store(store):
    from areal_jax.metrics import MetricsLogger, Timeline

    run = "fake-gs://bucket/run"
    logger = MetricsLogger(run, enabled=True, total_steps=3)
    records = [logger.log(s, {"reward": 0.1 * s}) for s in (1, 2, 3)]
    logger.flush()
    rows = [json.loads(x) for x in paths.read_text(paths.join(run, "metrics.jsonl")).splitlines()]
    assert [r["reward"] for r in rows] == [r["reward"] for r in records]
    logger.close()
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(store / "bucket" / "run"))

    timeline = Timeline(paths.join(run, "timeline.json"), max_buffered=2)
    for i in range(5):  # spooled to local scratch space twice, then saved to the store
        with timeline.span(f"s{i}", lane="trainer"):
            pass
    timeline.close()
    trace = json.loads((store / "bucket" / "run" / "timeline.json").read_text())
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == [f"s{i}" for i in range(5)]
    assert sorted(os.listdir(store / "bucket" / "run")) == sorted(
        ["metrics.jsonl", "timeline.json"] + [n for n in os.listdir(store / "bucket" / "run") if "tfevents" in n])


def test_checkpointer_on_the_store(store):
    from areal_jax.checkpoint import Checkpointer

    ckpt = Checkpointer("fake-gs://bucket/run", keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": jnp.arange(4.0) + step}, {"version": step, "prompts_state": {"pos": step}})
    state, meta = ckpt.restore(ckpt.latest_step(), {"w": jnp.zeros(4)})
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(4.0) + 3)
    assert meta == {"version": 3, "prompts_state": {"pos": 3}}
    ckpt.close()
    run = store / "bucket" / "run"
    assert sorted(os.listdir(run / "checkpoint_meta")) == ["2", "3"]  # pruned with orbax's steps
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "3"]


def _records(text: str) -> list[tuple]:
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(r["uid"], r["gid"], r["trained_version"], r["n"]) for r in rows]


@pytest.mark.long  # 19-24 s; the store's checkpointer, metrics, timeline and append files are tested above
def test_run_and_resume_on_the_store_match_a_file_url_run(tmp_path, store, monkeypatch):
    from areal_jax.programs.report import make_report, write_task_table
    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config, write_tiny_assets

    monkeypatch.chdir(tmp_path)  # anything written by a URL taken as a relative path would land here
    assets = str(tmp_path / "assets")
    write_tiny_assets(assets)
    records, logs = {}, {}
    for name, run_dir in (("file", f"file://{tmp_path}/local_run"), ("store", "fake-gs://bucket/run")):
        logs[name] = []
        for steps in (2, 4):  # the second job resumes from the first one's checkpoint at step 2
            c = tiny_config(assets, run_dir=run_dir, eta=1, steps=steps, write=False)
            job = RLJob(c, log_fn=logs[name].append)
            try:
                summary = job.run()
            finally:
                job.close()
            assert summary["steps"] == steps
        assert "Resumed from checkpoint step 2 (policy version 2)." in logs[name]
        records[name] = _records(paths.read_text(paths.join(run_dir, "samples.jsonl")))
    assert records["store"] == records["file"]
    assert [r[2] for r in records["store"]] == [0, 0, 1, 1, 2, 2, 3, 3]  # every step once, none twice

    run = store / "bucket" / "run"
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert json.loads((run / "config.json").read_text())["run_dir"] == "fake-gs://bucket/run"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert json.loads((run / "timeline.json").read_text())["traceEvents"]
    assert "prompts_state" in json.loads((run / "checkpoint_meta" / "4" / "process_0.json").read_text())
    assert "4" in os.listdir(run / "checkpoints")
    assert any("tfevents" in n for n in os.listdir(run))
    plots = make_report("fake-gs://bucket/run")
    assert plots == ["fake-gs://bucket/run/plots/curves.png", "fake-gs://bucket/run/plots/timeline.png"]
    assert (run / "plots" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table, summary = write_task_table("fake-gs://bucket/run")  # samples.jsonl read from the store, line by line
    assert table == "fake-gs://bucket/run/plots/tasks.csv" and summary["groups"] == len(records["store"])
    assert (run / "plots" / "tasks.csv").read_text().startswith("task,groups,samples,solved,")
    assert not [n for n in os.listdir(tmp_path) if n.startswith("fake-gs")]
