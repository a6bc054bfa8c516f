"""Two cooperating processes on this host (2 CPU devices each: 1 train + 1 rollout; the resumed run 1 train + 2
rollout replicas), gloo collectives.

Checked from each process's own records: params digests after every publish (the trainer's params,
gathered independently, are identical on both processes and equal what each rollout slice received and
decodes with), the staleness bound, resume from the multi-host checkpoint, and that killing one process
makes the other exit non-zero within 60 s, naming the dead process, instead of hanging in a collective
(detected by JAX's coordination service alone, with no heartbeat files; and with them switched on).
The run-and-resume test keeps its run directory on the fake object store (areal_jax.testing.fake_store).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launchers"))

from local import free_port, launch  # noqa: E402

from areal_jax.testing.tiny import write_tiny_assets  # noqa: E402

ETA = 1


def _job_args(assets, steps):
    return [f"--config={ROOT}/configs/tiny.py:{assets}", "--config.mesh.train_devices=1",
            "--config.mesh.rollout_devices=1", "--config.log.param_digests=True",
            f"--config.total_steps={steps}", f"--config.rollout.max_staleness={ETA}",
            "--config.distributed.heartbeat_timeout_s=15"]


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_digests(run_dir, steps, published_is_trainer=True):
    """published_is_trainer=False for LoRA's merged hand-off: the rollout slice gets the base with the adapters
    folded in, so what was published is compared across the processes instead of with the trainer's state."""
    rows = [_jsonl(os.path.join(run_dir, f"params_digests.process_{p}.jsonl")) for p in range(2)]
    assert [r["version"] for r in rows[0]] == list(range(1, steps + 1))
    assert [r["trainer"] for r in rows[0]] == [r["trainer"] for r in rows[1]]  # identical on both
    assert [r["published"] for r in rows[0]] == [r["published"] for r in rows[1]]
    for per_process in rows:
        published = {}
        for r in per_process:
            assert r["published_version"] == r["version"]
            assert r["published"] == r["trainer"] or not published_is_trainer
            published[r["version"]] = r["published"]
            if r["sampler_version"] in published:  # what the rollout slice decodes with
                assert r["sampler"] == published[r["sampler_version"]]
    assert len({r["trainer"] for r in rows[0]}) > 1  # the params really changed


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("multihost"))
    write_tiny_assets(directory)
    return directory


@pytest.mark.long  # (excluded from the default run: `-m long`)
def test_two_processes_async_steps_then_resume(assets, tmp_path, monkeypatch):
    """The run directory is on the fake object store (areal_jax.testing.fake_store), as on a pod without a
    shared disk: every file, the per-process ones and the checkpoint metadata included, goes through
    the path layer, and the resume reads them back from there."""
    store = tmp_path / "store"
    monkeypatch.setenv("AREAL_FAKE_STORE_ROOT", str(store))
    monkeypatch.setenv("AREAL_JAX_SCRATCH", str(tmp_path / "scratch"))
    store_dir = ["--config.run_dir=fake-gs://bucket/mh", "--config.rollout.retire_unsolved=1"]
    run_dir = str(store / "bucket" / "mh")  # where the fake store keeps the objects
    code = launch(2, 2, ["areal_jax.main", *_job_args(assets, 3), *store_dir], os.path.join(assets, "logs1"),
                  module="areal_jax.testing.fake_store",
                  timeout_s=400, echo=False)
    assert code == 0, open(os.path.join(assets, "logs1", "process_0.log")).read()[-3000:]
    _check_digests(run_dir, 3)
    for p in range(2):
        samples = _jsonl(os.path.join(run_dir, f"samples.process_{p}.jsonl"))
        assert [s["trained_version"] for s in samples] == [0, 1, 2]  # one local group per step
        assert all(s["trained_version"] - s["min_token_version"] <= ETA for s in samples)
        assert os.path.exists(os.path.join(run_dir, "checkpoint_meta", "3", f"process_{p}.json"))
    assert not os.path.exists(os.path.join(run_dir, "samples.jsonl"))  # per-process files only
    retired = [json.load(open(os.path.join(run_dir, "checkpoint_meta", "3", f"process_{p}.json")))["retirement"]
               ["retired"] for p in range(2)]  # each process retires the tasks of its own shard
    assert any(retired) and not set(retired[0]) & set(retired[1])
    # Resume from the multi-host checkpoint and continue to step 5, now with two rollout replicas per process (one
    # sampler on each of two devices; the checkpoint holds nothing of the rollout layout).
    replicas = ["--config.mesh.rollout_devices=2", "--config.mesh.rollout_tensor=1"]
    code = launch(2, 3, ["areal_jax.main", *_job_args(assets, 5), *store_dir, *replicas], os.path.join(assets, "logs2"),
                  module="areal_jax.testing.fake_store",
                  timeout_s=400, echo=False)
    log0 = open(os.path.join(assets, "logs2", "process_0.log")).read()
    assert code == 0, log0[-3000:]
    assert "Resumed from checkpoint step 3" in log0
    assert "(rollout: 2 replicas x 1 tensor device)" in log0, log0[-3000:]
    _check_digests(run_dir, 5)
    assert json.load(open(os.path.join(run_dir, "summary.json")))["steps"] == 5  # written by process 0
    for p in range(2):  # restored from its own meta file, and kept
        meta = json.load(open(os.path.join(run_dir, "checkpoint_meta", "5", f"process_{p}.json")))
        assert retired[p].items() <= meta["retirement"]["retired"].items()
    assert os.listdir(tmp_path / "scratch" / "areal_jax") == []  # local mirrors removed at the end


# How the survivor's stderr names the dead peer: JAX's coordination service (in process 0) reports a
# worker by its task number; a worker that loses process 0 reports the leader task.
PEER_NAMED = {1: re.compile(r"Task 1 heartbeat timeout|stopped sending heartbeats\):\s*1\b"),
              0: re.compile(r"leader task")}
# With distributed.file_heartbeats=True the file watchdog may name it first, in its own words.
FILE_WATCHDOG_NAMED = re.compile(r"process 1 has not sent a heartbeat")


@pytest.mark.slow
@pytest.mark.parametrize("victim, file_heartbeats", [(1, False), (0, False), (1, True)])
def test_killing_one_process_makes_the_other_exit(assets, tmp_path, victim, file_heartbeats):
    """Without heartbeat files (distributed.file_heartbeats=False, the default) the coordination service
    alone must notice the SIGKILLed peer, end the survivor with a non-zero code within 60 s, and say
    which process died; with them, the same holds whichever of the two notices first."""
    address = f"127.0.0.1:{free_port()}"
    procs, logs = [], []
    run_dir = str(tmp_path / "run")
    for i in range(2):
        env = dict(os.environ, AREAL_COORDINATOR=address, AREAL_NUM_PROCESSES="2", AREAL_PROCESS_ID=str(i),
                   JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
        logs.append(open(tmp_path / f"process_{i}.log", "w"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "areal_jax.main", *_job_args(assets, 500), f"--config.run_dir={run_dir}",
             f"--config.distributed.file_heartbeats={file_heartbeats}"],
            env=env, cwd=ROOT, stdout=logs[i], stderr=subprocess.STDOUT, start_new_session=True))
    survivor = procs[1 - victim]
    try:
        digests = os.path.join(run_dir, "params_digests.process_0.jsonl")
        deadline = time.time() + 300
        while not os.path.exists(digests) and time.time() < deadline:
            assert all(p.poll() is None for p in procs), "a process died before training started"
            time.sleep(0.2)
        assert os.path.exists(digests), "training did not start"
        os.killpg(procs[victim].pid, signal.SIGKILL)
        t0 = time.time()
        code = survivor.wait(timeout=90)
        waited = time.time() - t0
        print(f"process {1 - victim} exited with code {code} {waited:.1f} s after process {victim} was killed")
        assert code != 0
        assert waited < 60, f"the surviving process took {waited:.0f} s to exit"
        beats = sorted(os.listdir(os.path.join(run_dir, "heartbeats"))) if file_heartbeats else []
        assert os.path.exists(os.path.join(run_dir, "heartbeats")) == file_heartbeats
        assert beats[:2] == (["hb.0", "hb.1"] if file_heartbeats else [])
        log = (tmp_path / f"process_{1 - victim}.log").read_text(errors="replace")
        assert PEER_NAMED[victim].search(log) or (file_heartbeats and FILE_WATCHDOG_NAMED.search(log)), log[-3000:]
    finally:
        for p in procs:  # SIGKILL: jax.distributed catches SIGTERM
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()


@pytest.mark.slow
@pytest.mark.long  # 31 s in CI: the two-process update is this file's other runs', LoRA's hand-off tests/test_lora.py's
def test_two_processes_train_a_value_head_beside_lora_adapters(assets, tmp_path):
    """train.critic=value_head with LoRA across two processes: both finish, agree on the trained weights after
    every publish (digests), and report a finite value loss at every step. They save by process 0's clock
    (checkpoint.every_minutes): a save is a collective, so both must decide alike at every step."""
    run_dir = str(tmp_path / "run")
    logs = str(tmp_path / "logs")
    code = launch(2, 2, [*_job_args(assets, 3), f"--config.run_dir={run_dir}",
                         "--config.train.critic=value_head", "--config.lora.enabled=True", "--config.lora.rank=4",
                         "--config.train.lr=3e-3", "--config.checkpoint.every_steps=0",
                         "--config.checkpoint.every_minutes=1e-9", "--config.checkpoint.keep=5"],
                  logs, timeout_s=400, echo=False)
    assert code == 0, open(os.path.join(logs, "process_0.log")).read()[-3000:]
    assert sorted(int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.isdigit()) == [1, 2, 3]
    _check_digests(run_dir, 3, published_is_trainer=False)
    rows = [r for r in _jsonl(os.path.join(run_dir, "metrics.jsonl")) if "train/value_loss" in r]
    assert len(rows) == 3 and all(0 <= r["train/value_loss"] < float("inf") for r in rows), rows
