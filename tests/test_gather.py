"""system.gather.allgather_trajectories with two processes emulated in one: a fake allgather stacks what
each "process" sends, and every field of every trajectory must arrive exactly as it was sent."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from areal_jax.system.gather import allgather_trajectories
from areal_jax.trainer.batch import Trajectory


def _trajectory(rng: np.random.Generator, prompt_len: int, completion: int, *, token_adv: bool, mask: bool,
                routes: bool = False):
    return Trajectory(
        tokens=rng.integers(0, 50, prompt_len + completion).astype(np.int32), prompt_len=prompt_len,
        behav_logp=-rng.random(completion).astype(np.float32),
        versions=rng.integers(0, 5, completion).astype(np.int32), advantage=float(rng.normal()),
        reward=float(rng.random()),
        token_advantages=rng.normal(size=completion).astype(np.float32) if token_adv else None,
        loss_mask=(rng.random(completion) > 0.3).astype(np.float32) if mask else None,
        routes=rng.integers(0, 8, (prompt_len + completion, 2, 3)).astype(np.int32) if routes else None)


def _same(a: Trajectory, b: Trajectory) -> None:
    assert a.prompt_len == b.prompt_len and a.advantage == b.advantage and a.reward == b.reward
    for name in ("tokens", "behav_logp", "versions", "token_advantages", "loss_mask", "routes"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("routes", [False, True])
def test_two_processes_receive_every_field_in_process_order(routes):
    """Two threads stand in for two processes; the allgather meets at a barrier per collective. routes: the
    sampler's experts of every token (train.router_replay), [tokens, 2, 3] each."""
    rng = np.random.default_rng(0)
    per_process = [
        [_trajectory(rng, 3, 5, token_adv=False, mask=False, routes=routes),
         _trajectory(rng, 2, 9, token_adv=True, mask=True, routes=routes)],
        [_trajectory(rng, 4, 2, token_adv=True, mask=False, routes=routes),
         _trajectory(rng, 1, 7, token_adv=False, mask=True, routes=routes)],
    ]
    barrier = threading.Barrier(2, timeout=30)
    slots: list[np.ndarray | None] = [None, None]
    results: list[list[Trajectory] | None] = [None, None]

    def run(process: int) -> None:
        def allgather(x: np.ndarray) -> np.ndarray:
            slots[process] = x
            barrier.wait()  # both have deposited
            out = np.stack([slots[0], slots[1]])
            barrier.wait()  # both have read before the next collective overwrites
            return out

        results[process] = allgather_trajectories(per_process[process], process_count=2, allgather=allgather)

    threads = [threading.Thread(target=run, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = per_process[0] + per_process[1]
    for got in results:
        assert got is not None and len(got) == 4
        for a, b in zip(got, expected):
            _same(a, b)


def test_one_process_is_the_identity_and_unequal_counts_are_an_error():
    rng = np.random.default_rng(1)
    trajs = [_trajectory(rng, 2, 3, token_adv=False, mask=False)]
    assert allgather_trajectories(trajs, process_count=1) == trajs
    with pytest.raises(RuntimeError, match="different numbers of trajectories"):
        allgather_trajectories(trajs, process_count=2, allgather=lambda x: np.stack([x, x + 1]))
