"""The asynchronous RL loop: the sampler generates all the time, the trainer consumes batches.

Threads (one process): the SamplerLoop thread decodes; the RolloutController thread admits prompts
under the staleness bound, scores completions in the RewardPool's worker processes and fills the
TrajectoryBuffer; the main thread (here) takes B groups in admission order, runs the PPO update on the
train slice, and publishes the new version through the ParamChannel. Synchronous RL is this same code
with rollout.max_staleness = 0: the controller then admits only the batch the trainer will take next.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from areal_jax.system.buffer import Group, TrajectoryBuffer
from areal_jax.system.interfaces import ManagedSampler

if TYPE_CHECKING:
    from areal_jax.system.controller import RolloutController
    from areal_jax.trainer.batch import Trajectory


def groups_to_trajectories(groups: list[Group]) -> list[Trajectory]:
    """Flatten complete groups into trainer Trajectories (prompt + completion, behaviour data)."""
    from areal_jax.trainer.batch import Trajectory

    out = []
    for g in groups:
        prompt = np.asarray(g.example.prompt_tokens, np.int32)
        shaped = g.rewards if g.shaped_rewards is None else g.shaped_rewards  # a critic's terminal reward
        token_advantages = g.token_advantages or [None] * len(g.completions)
        for c, reward, adv, token_adv in zip(g.completions, shaped, g.advantages, token_advantages):
            tokens = np.concatenate([prompt, np.asarray(c.tokens, np.int32)])
            out.append(
                Trajectory(
                    tokens=tokens,
                    prompt_len=len(prompt),
                    behav_logp=np.asarray(c.logprobs, np.float32),
                    versions=np.asarray(c.versions, np.int32),
                    advantage=float(adv),
                    token_advantages=token_adv,  # a multi-turn sample's: its attempts credited apart
                    reward=float(reward),
                    loss_mask=getattr(c, "loss_mask", None),  # a multi-turn sample's feedback tokens: out of the loss
                    routes=getattr(c, "routes", None),  # the sampler's experts of prompt + completion (router_replay)
                )
            )
    return out


def batch_summary(groups: list[Group], trainer_version: int) -> dict[str, float]:
    """Reward, accuracy, lengths and staleness of the groups about to be trained at trainer_version."""
    rewards = np.concatenate([g.rewards for g in groups])
    lengths = np.array([len(c.tokens) for g in groups for c in g.completions])
    min_versions = np.array([int(np.min(c.versions)) if len(c.versions) else trainer_version
                             for g in groups for c in g.completions])
    stale = trainer_version - min_versions
    finished_eos = np.mean([c.finish_reason == "stop" for g in groups for c in g.completions])
    return {
        "reward": float(rewards.mean()),
        "accuracy": float(np.mean(rewards >= 1.0)),
        "completion_len": float(lengths.mean()),
        "completion_len_max": float(lengths.max()),
        "stop_fraction": float(finished_eos),
        "staleness": float(stale.mean()),
        "staleness_max": float(stale.max()),
        "group_reward_std": float(np.mean([g.rewards.std() for g in groups])),
        # Groups whose samples all scored alike: zero group advantage, so generated for no gradient.
        "uniform_group_fraction": float(np.mean([np.all(g.rewards == g.rewards[0]) for g in groups])),
        "completion_tokens": float(lengths.sum()),
    }


class SampleLog:
    """samples.jsonl: one line per trained group (uid, admission and token versions, trained version).

    It is what lets a test (or a user) check from the record that no trained sample was staler than eta
    and that every completion was trained exactly once. On resume, lines from steps after the restored
    checkpoint are dropped, since those steps are run again.
    """

    def __init__(self, run_dir: str, enabled: bool = True):
        # Each process records the groups it generated: samples.jsonl alone, samples.process_<i>.jsonl
        # when a run spans several processes. run_dir may be an object store (areal_jax.paths).
        import jax

        from areal_jax import paths

        name = "samples.jsonl" if jax.process_count() == 1 else f"samples.process_{jax.process_index()}.jsonl"
        self.path = paths.join(run_dir, name)
        self.enabled = enabled
        self._file = paths.AppendFile(self.path) if enabled else None

    def truncate_from(self, version: int) -> None:
        """Keep only the lines of steps before `version`; a line cut short by a crash is dropped too."""
        if self._file is None:
            return
        keep = []
        for ln in self._file.read_text().splitlines(keepends=True):
            try:
                row = json.loads(ln) if ln.endswith("\n") else None
            except json.JSONDecodeError:
                row = None  # torn by a kill in the middle of write()
            if row is not None and row["trained_version"] < version:
                keep.append(ln)
        self._file.rewrite("".join(keep))

    def sync(self) -> None:
        """Make the lines written so far durable in the run directory (uploads on an object store)."""
        if self._file is not None:
            self._file.sync()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, groups: list[Group], trained_version: int) -> None:
        if not self.enabled:
            return
        lines = []
        for g in groups:
            versions = [int(np.min(c.versions)) if len(c.versions) else -1 for c in g.completions]
            lines.append(json.dumps({
                "uid": g.example.uid, "gid": g.gid, "admit_version": g.admit_version,
                "min_token_version": min(versions),
                "max_token_version": max(int(np.max(c.versions)) if len(c.versions) else -1
                                         for c in g.completions),
                "trained_version": trained_version, "n": len(g.completions),
                "rewards": [float(r) for r in g.rewards],
            }) + "\n")
        self._file.write("".join(lines))  # one write per step: a kill leaves at most one torn line


class CheckpointClock:
    """When the loop saves: after every `every_steps`-th step, and once `every_minutes` have passed since the last
    save (or the loop's start), checked after each step. A save is a collective, so with several processes the
    clock of process 0 decides for all: one broadcast of a flag per step, only when `every_minutes` is set.

    clock / broadcast: time.monotonic and a function giving every process process 0's value (tests pass theirs).
    """

    def __init__(self, every_steps: int, every_minutes: float, *, clock: Callable[[], float] = time.monotonic,
                 broadcast: Callable[[bool], bool] | None = None):
        self.every_steps, self.every_s = int(every_steps), 60.0 * float(every_minutes)
        self._clock, self._broadcast = clock, broadcast
        self._last = clock()

    def saved(self) -> None:
        self._last = self._clock()

    def due(self, step: int) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        if self.every_s <= 0:
            return False
        late = self._clock() - self._last >= self.every_s
        broadcast = self._broadcast if self._broadcast is not None else _from_process_0
        return bool(broadcast(late))


def _from_process_0(flag: bool) -> bool:
    import jax

    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


class StopFlag:
    """First Ctrl-C (or SIGTERM) asks the loop to checkpoint and exit; a second one aborts at once."""

    def __init__(self):
        self.requested = threading.Event()
        self._installed = False
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if self.requested.is_set():
                raise KeyboardInterrupt
            print(f"\nSignal {signum}: saving a checkpoint and stopping (press Ctrl-C again to abort).",
                  flush=True)
            self.requested.set()

        # SIGTERM is what schedulers (SLURM, Kubernetes) send before they kill a job.
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, handler)
        self._installed = True

    def restore(self) -> None:
        """Put back the handlers that were there before install() (the run is over)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous, self._installed = {}, False


def wait_for_batch(buffer: TrajectoryBuffer, n: int, controller: RolloutController, sampler: ManagedSampler,
                   stop: StopFlag, timeout_s: float) -> list[Group] | None:
    """Block for the next batch, re-raising errors from the rollout threads; None if asked to stop."""
    deadline = time.monotonic() + timeout_s
    while not stop.requested.is_set():
        groups = buffer.get_batch(n, timeout=0.5)
        if groups is not None:
            return groups
        controller.check()
        sampler.check()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"No batch of {n} groups became ready in {timeout_s:.0f} s: the sampler or the reward pool "
                f"is stuck (controller counters: {dict(controller.counters)})."
            )
    return None


def record_digests(trainer, channel, sampler: ManagedSampler, log) -> None:
    """Append to `log` (log.param_digests) fingerprints of the trainer's params (gathered independently of the
    ParamChannel), of what the rollout slice received, and of what the sampler decodes with now."""
    import jax
    from jax.experimental import multihost_utils

    from areal_jax.runtime import multihost

    trainer_params = trainer.params
    if jax.process_count() > 1:
        trainer_params = multihost_utils.process_allgather(trainer_params, tiled=True)
    version, published = channel.latest()
    sampler_version, sampler_params = sampler.versioned_params()
    row = {"version": trainer.version, "trainer": multihost.params_digest(trainer_params),
           "published_version": version, "published": multihost.params_digest(published),
           "sampler_version": sampler_version, "sampler": multihost.params_digest(sampler_params)}
    log.write(json.dumps(row) + "\n")
