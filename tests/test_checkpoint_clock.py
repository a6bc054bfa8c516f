"""checkpoint.every_minutes: a save once that long has passed since the last one, decided by process 0's clock."""
from __future__ import annotations

import os

import pytest

from areal_jax.system.job import RLJob
from areal_jax.system.runner import CheckpointClock
from areal_jax.testing.tiny import tiny_config


def test_every_steps_and_every_minutes_worked_by_hand():
    now = [100.0]
    clock = CheckpointClock(every_steps=5, every_minutes=2.0, clock=lambda: now[0], broadcast=lambda flag: flag)
    decisions = []
    for step, t in ((1, 150.0), (2, 219.9), (3, 220.0), (4, 230.0), (5, 231.0), (6, 400.0)):
        now[0] = t
        due = clock.due(step)
        decisions.append(due)
        if due:
            clock.saved()
    # 120 s after the start (t=100) is t=220: due at step 3; saved then, the next at 340; step 5 by count.
    assert decisions == [False, False, True, False, True, True]
    assert not CheckpointClock(every_steps=0, every_minutes=0.0, broadcast=lambda flag: 1 / 0).due(7)


def test_process_0_decides_for_every_process():
    seen = []

    def process_0_says_no(flag):  # what broadcast_one_to_all gives a process whose own clock says yes
        seen.append(flag)
        return False

    clock = CheckpointClock(every_steps=0, every_minutes=1.0, clock=iter([0.0, 61.0]).__next__,
                            broadcast=process_0_says_no)
    assert not clock.due(1) and seen == [True]


@pytest.mark.slow
def test_a_job_saves_by_the_clock_alone(tmp_path):
    assets, run_dir = str(tmp_path / "assets"), str(tmp_path / "run")
    c = tiny_config(assets, run_dir=run_dir, steps=3)
    c.checkpoint.every_steps = 0  # only the clock, and the save at the end
    c.checkpoint.every_minutes = 1e-9
    c.checkpoint.keep = 10
    c.log.tensorboard = False
    job = RLJob(c, log_fn=lambda *a, **k: None)
    try:
        assert job.run()["steps"] == 3
    finally:
        job.close()
    assert sorted(int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.isdigit()) == [1, 2, 3]
