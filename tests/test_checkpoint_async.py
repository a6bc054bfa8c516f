"""Asynchronous checkpoint saves (checkpoint.async_save): the caller goes on while orbax writes, and nothing a
crash, a reader or a donating update can do in that window breaks a checkpoint.

Orbax's background thread is held just before its commit (the rename that makes a step visible) by a gate, so
each test sees the write in flight for as long as it needs.
"""
from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.checkpointers import async_checkpointer

from areal_jax import checkpoint, orbax_compat
from areal_jax.checkpoint import Checkpointer, CheckpointWriteError, local_state_bytes


@pytest.fixture
def gate(monkeypatch):
    """An Event the background write waits on before committing; set on teardown so no thread is left."""
    event = threading.Event()
    real = async_checkpointer._on_commit_callback

    def held(*args, **kw):
        assert event.wait(60), "the test never released the write"
        return real(*args, **kw)

    monkeypatch.setattr(async_checkpointer, "_on_commit_callback", held)
    yield event
    event.set()


def _state(seed: float) -> dict:
    return {"w": jnp.arange(12.0).reshape(3, 4) + seed, "b": [jnp.ones(5) * seed, jnp.zeros(2, jnp.int32)]}


def test_save_returns_while_writing_and_a_reader_never_sees_the_step_half_done(tmp_path, gate):
    written = []
    ck = Checkpointer(str(tmp_path), keep=2, async_save=True, on_written=lambda s, t: written.append((s, t)))
    ck.save(1, _state(1.0), {"version": 1})
    assert ck.pending_step == 1 and ck.has_step(1) and written == []
    assert orbax_compat.active()  # the tensorstore workaround stays on for the background write
    # Another process resuming now (or the export command) finds no step: the write is not committed.
    reader = Checkpointer(str(tmp_path), keep=2)
    assert reader.latest_step() is None
    assert os.path.exists(tmp_path / "checkpoint_meta" / "1" / "process_0.json")  # meta goes first

    gate.set()
    ck.wait()
    assert ck.pending_step is None and not orbax_compat.active()
    assert [s for s, _ in written] == [1] and written[0][1] > 0 and ck.last_write_s == written[0][1]
    assert reader.latest_step() == 1
    restored, meta = reader.restore(1, _state(0.0))
    assert meta == {"version": 1}
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(12.0).reshape(3, 4) + 1)
    reader.close()
    ck.close()


def test_buffers_donated_during_the_write_are_saved_as_they_were_at_save(tmp_path, gate):
    # The trainer donates its state to the next update while the write may still be running.
    state = {"w": jnp.arange(1 << 16, dtype=jnp.float32) * 0.5, "m": jnp.full((256, 256), 3.0)}
    expect = jax.tree.map(np.array, state)  # host copies made before anything can change them
    ck = Checkpointer(str(tmp_path), async_save=True)
    ck.save(7, state, {"version": 7})
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)
    for _ in range(3):  # each call may reuse (overwrite) the buffers it was given
        state = step(state)
    jax.block_until_ready(state)
    gate.set()
    restored, _ = ck.restore(7, state)  # waits for the write
    for k in expect:
        np.testing.assert_array_equal(np.asarray(restored[k]), expect[k])
    ck.close()


def test_a_failed_write_is_raised_at_the_next_save_naming_the_step(tmp_path, monkeypatch):
    def broken(*args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(async_checkpointer, "_on_commit_callback", broken)
    ck = Checkpointer(str(tmp_path), async_save=True)
    ck.save(1, _state(1.0), {"version": 1})
    with pytest.raises(CheckpointWriteError, match=r"Checkpoint step 1 could not be written .*No space left"):
        ck.save(2, _state(2.0), {"version": 2})
    assert ck.pending_step is None and not orbax_compat.active()
    monkeypatch.undo()  # the disk has room again: the run can save its next step
    ck.save(2, _state(2.0), {"version": 2})
    assert ck.latest_step() == 2 and ck.all_steps() == [2]
    assert sorted(os.listdir(tmp_path / "checkpoint_meta")) == ["2"]  # the failed step's meta is gone too
    ck.close()


def test_close_finishes_the_write_and_sync_saves_hold_the_caller(tmp_path):
    async_ck = Checkpointer(str(tmp_path / "a"), keep=1, async_save=True)
    sync_ck = Checkpointer(str(tmp_path / "s"), keep=1)
    for step in (1, 2):
        for ck in (async_ck, sync_ck):
            ck.save(step, _state(float(step)), {"version": step})
    assert sync_ck.pending_step is None and sync_ck.last_write_s <= sync_ck.last_blocked_s
    async_ck.close()  # the run's end: nothing is left half-written
    sync_ck.close()
    for d in ("a", "s"):
        assert sorted(os.listdir(tmp_path / d / "checkpoints")) == ["2"]
        again = Checkpointer(str(tmp_path / d))
        restored, meta = again.restore(again.latest_step(), _state(0.0))
        assert meta == {"version": 2}
        np.testing.assert_array_equal(np.asarray(restored["b"][0]), np.full(5, 2.0))
        again.close()


def test_a_save_blocks_while_the_host_lacks_memory_for_the_copy(tmp_path, monkeypatch, gate):
    state = _state(1.0)
    assert local_state_bytes(state) == (12 + 5 + 2) * 4
    free = [2 * local_state_bytes(state)]  # below the 2.5 copies a background save is given
    monkeypatch.setattr(checkpoint, "available_host_bytes", lambda: free[0])
    lines = []
    ck = Checkpointer(str(tmp_path), async_save=True, log=lines.append)
    gate.set()
    for step in (1, 2):
        ck.save(step, state, {"version": step})
        assert ck.pending_step is None and ck.all_steps()[-1] == step  # written before save() returned
    assert ck.blocking_fallbacks == 2 and len(lines) == 1  # said once
    assert "Checkpoint step 1 is written before training goes on" in lines[0]
    assert "--config.checkpoint.async_save=False" in lines[0]
    free[0] = 10**12  # memory again: back in the background
    gate.clear()
    ck.save(3, state, {"version": 3})
    assert ck.pending_step == 3 and ck.blocking_fallbacks == 2
    gate.set()
    ck.close()


def test_local_state_bytes_counts_each_shard_this_process_writes_once():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    x = jnp.zeros((8, 16), jnp.float32)
    replicated = jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    split = jax.device_put(x, NamedSharding(mesh, PartitionSpec("a", "b")))
    half = jax.device_put(x, NamedSharding(mesh, PartitionSpec("a")))  # each row block on two devices
    for arr in (replicated, split, half):
        assert local_state_bytes({"w": arr, "n": 3}) == 8 * 16 * 4


def test_pruning_spares_a_newer_step_another_process_is_saving(tmp_path):
    """Meta directories of steps newer than the newest kept step may belong to a save in progress on another
    process (its directory made, its file not yet written): pruning removes only older ones."""
    ck = Checkpointer(str(tmp_path), keep=1, async_save=True)
    ck.save(1, _state(1.0), {"version": 1})
    in_progress = tmp_path / "checkpoint_meta" / "3"
    in_progress.mkdir()  # another process's save of step 3, between its makedirs and its write
    ck.save(2, _state(2.0), {"version": 2})
    ck.wait()  # prunes
    assert ck.all_steps() == [2] and in_progress.is_dir()
    assert sorted(os.listdir(tmp_path / "checkpoint_meta")) == ["2", "3"]  # step 1's own meta went with its state
    ck.close()
