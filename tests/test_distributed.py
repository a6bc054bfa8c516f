"""Start-up settings for jax.distributed and the optional file-heartbeat watchdog (in one process).

The coordination service's own failure detection is exercised end to end by the 2-process kill tests
in tests/test_multihost.py; here: the timeout it is given, and what the file watchdog reports.
"""
from __future__ import annotations

import threading

import jax
import pytest

from areal_jax import config as config_lib
from areal_jax.runtime import distributed


@pytest.mark.parametrize("timeout_s, expected", [(60.0, 60), (15.0, 15), (2.5, 3), (1.0, 1)])
def test_heartbeat_timeout_seconds_rounds_up(timeout_s, expected):
    c = config_lib.base_config()
    c.distributed.heartbeat_timeout_s = timeout_s
    assert distributed.heartbeat_timeout_seconds(c) == expected


def test_initialize_hands_the_heartbeat_timeout_to_jax(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    c = config_lib.base_config()
    c.distributed.coordinator_address, c.distributed.num_processes, c.distributed.process_id = "127.0.0.1:1", 2, 1
    c.distributed.heartbeat_timeout_s = 12.5
    info = distributed.initialize(c)
    assert calls == [dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1,
                          heartbeat_timeout_seconds=13)]
    assert info["heartbeat_timeout_s"] == 13 and info["mode"] == "explicit"
    assert updates == [("jax_cpu_collectives_implementation", "gloo")]  # CPU processes talk through gloo
    c.distributed.process_id = None
    with pytest.raises(ValueError, match="process_id"):
        distributed.initialize(c)


def test_single_process_does_not_start_the_runtime(monkeypatch):
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("initialize was called"))
    for var in ("AREAL_COORDINATOR", "SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "CLOUD_TPU_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize(config_lib.base_config()) == {"mode": "single"}


def test_file_watchdog_names_a_silent_peer_and_ignores_a_finished_one(tmp_path):
    dead = []
    got = threading.Event()

    def on_dead(msg):
        dead.append(msg)
        got.set()

    watchers = [distributed.PeerWatchdog(str(tmp_path), i, 3, interval_s=0.05, timeout_s=0.6, on_dead=on_dead)
                for i in range(3)]
    watchers[0].start()
    watchers[1].start()
    watchers[2].start()
    watchers[2].finish()  # finished cleanly: never reported
    watchers[1]._stop.set()  # stops beating without finishing, as a killed process would
    assert got.wait(10), "the silent peer was not reported"
    watchers[0].finish()
    assert len(dead) == 1 and dead[0].startswith("process 1 has not sent a heartbeat"), dead
    assert "process 0 exits" in dead[0]


def test_runtime_failures_are_told_from_the_programs_own_errors():
    assert distributed.is_runtime_failure(ValueError("UNKNOWN: Gloo AllGather failed: Connection reset by peer"))
    assert distributed.is_runtime_failure(RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service"))
    assert not distributed.is_runtime_failure(ValueError("train.lr=-1 must be positive."))
    assert not distributed.is_runtime_failure(KeyError("reward"))
    assert not distributed.is_runtime_failure(KeyboardInterrupt())
