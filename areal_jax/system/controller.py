"""RolloutController: admission under the staleness bound, rewards, and group assembly.

A thread that keeps the sampler busy without ever letting a trained token be more than eta versions old:
  1. admit: while rl.staleness.rollout_capacity allows, draw a prompt and submit one sampler Request of
     n = group_size samples (a GRPO group, prefilled once);
  2. score: send each finished completion's text to the RewardPool (worker processes, timeouts);
  3. assemble: when a group has all its rewards, shape them (DAPO's overlong penalty, if on), compute its
     advantages, optionally filter it (DAPO: all rewards equal), and hand it to the TrajectoryBuffer,
     which serves the trainer in admission order;
  4. retire: with rollout.retire_solved / retire_unsolved, a task whose recent groups all solved it (or none did)
     is skipped when the prompt stream serves it again (system/retire.py).
Counting is in groups: accepted (cumulative, complete and not filtered) + running (admitted, not
complete) is what the admission rule bounds by (eta + v + 1) * B, with v the sampler's params version.
With ``turns`` (sampler.turns.FeedbackTurns, rollout.feedback_turns > 0) a finished sample may first go back to the
sampler with execution feedback, as a continuation request, before it is scored.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from areal_jax.rl.advantages import group_advantages, overlong_penalty
from areal_jax.rl.staleness import rollout_capacity
from areal_jax.sampler.config import RolloutConfig
from areal_jax.sampler.requests import Request
from areal_jax.system.buffer import Group, TrajectoryBuffer
from areal_jax.system.interfaces import PromptStream, RewardService, RolloutSampler
from areal_jax.system.retire import TaskRetirement
from areal_jax.timeline import SpanRecorder

if TYPE_CHECKING:
    from areal_jax.data.prompts import PromptExample
    from areal_jax.sampler.turns import FeedbackTurns


class RolloutController:
    """Drives the SamplerLoop and RewardPool from a thread and fills a TrajectoryBuffer.

    Args:
      config: the rollout section (group size, sampling, eta, advantage mode).
      sampler: a running sampler (interfaces.RolloutSampler: a SamplerLoop).
      reward_pool: where completions are scored (interfaces.RewardService: a RewardPool).
      prompts: the prompt stream (interfaces.PromptStream: a data.PromptIterator); its position is
        saved by snapshot().
      decode: token ids -> completion text (for the reward).
      buffer: where complete groups go.
      resubmit: examples admitted before a checkpoint but not trained; admitted first, in order.
      accepted: accepted groups so far (restored from a checkpoint: trained groups).
      first_gid: admission number of the next group.
      batch_groups: B of the admission rule: this process's share of train.batch_groups.
      stop_token_ids: tokens that end a completion (the tokenizer's end-of-sequence ids).
      turns: multi-turn rollouts with execution feedback (None: one turn per sample).
      retirement: TaskRetirement.state() of the run this one continues (None: nothing retired yet).
    """

    def __init__(
        self,
        config: RolloutConfig,
        sampler: RolloutSampler,
        reward_pool: RewardService,
        prompts: PromptStream,
        decode: Callable[[list[int]], str],
        buffer: TrajectoryBuffer,
        *,
        batch_groups: int,
        stop_token_ids: tuple[int, ...] = (),
        resubmit: list[PromptExample] | None = None,
        accepted: int = 0,
        first_gid: int = 0,
        timeline: SpanRecorder | None = None,
        turns: FeedbackTurns | None = None,
        retirement: dict | None = None,
    ):
        self.s = config
        self.batch_groups = batch_groups
        self.stop_token_ids = tuple(stop_token_ids)
        self.sampler = sampler
        self.rewards = reward_pool
        self.prompts = prompts
        self.decode = decode
        self.buffer = buffer
        self.timeline = timeline
        self.turns = turns
        self._resubmit = collections.deque(resubmit or [])
        self._lock = threading.RLock()
        self._groups: dict[int, dict] = {}  # gid -> in-progress record
        self._next_gid = first_gid
        self.accepted = accepted
        self.running = 0
        self.counters = collections.Counter()
        if turns is not None:
            turns.counters = self.counters  # its feedback_* counts beside the controller's
            turns.timeline = timeline
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._exhausted = False
        self.retirement = TaskRetirement(config.retire_solved, config.retire_unsolved)
        self.retirement.load_state(retirement)

    # ---- thread control -------------------------------------------------------------------------
    def start(self) -> "RolloutController":
        self._thread = threading.Thread(target=self._run, name="rollout-controller", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.turns is not None:
            self.turns.close()

    def pause_admission(self) -> None:
        self._paused.set()

    def resume_admission(self) -> None:
        self._paused.clear()

    def check(self) -> None:
        """Re-raise an error from the controller thread in the caller."""
        if self.error is not None:
            raise RuntimeError("the rollout controller stopped with an error") from self.error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                admitted = 0 if self._paused.is_set() else self._admit()
                got = self._drain_sampler()
                scored = self._drain_rewards()
                if self.turns is not None:
                    got += self._drain_turns()
                if not (admitted or got or scored):
                    time.sleep(0.002)
        except BaseException as e:  # surfaced through check() and the buffer
            self.error = e
            self.buffer.fail(e)

    # ---- 1. admission -----------------------------------------------------------------------------
    def capacity(self) -> int:
        return rollout_capacity(
            version=self.sampler.current_version,
            batch_size=self.batch_groups,
            max_staleness=self.s.eta,
            accepted=self.accepted,
            running=self.running,
            max_concurrent=self.s.max_concurrent,
        )

    def _next_example(self) -> PromptExample | None:
        if self._resubmit:
            return self._resubmit.popleft()
        skipped = 0
        while not self._exhausted:
            try:
                example = next(self.prompts)
            except StopIteration:
                self._exhausted = True
                return None
            if not self.retirement.is_retired(example.uid):
                return example
            self.counters["skipped_retired"] += 1
            skipped += 1
            if skipped >= getattr(self.prompts, "pass_draws", float("inf")):  # a whole pass: every task is retired
                self.retirement.start_over()
        return None

    def _admit(self) -> int:
        n = 0
        with self._lock:
            version = self.sampler.current_version
            cap = self.capacity()
            while n < cap:
                example = self._next_example()
                if example is None:
                    break
                gid = self._next_gid
                self._next_gid += 1
                self._groups[gid] = {
                    "example": example,
                    "version": version,
                    "completions": [None] * self.s.group_size,
                    "rewards": [None] * self.s.group_size,
                    "status": [None] * self.s.group_size,
                }
                self.buffer.admitted(gid)
                self.sampler.submit(
                    Request(
                        id=gid,
                        prompt=list(example.prompt_tokens),
                        max_new_tokens=self.s.max_new_tokens,
                        n=self.s.group_size,
                        temperature=self.s.temperature,
                        top_k=self.s.top_k,
                        top_p=self.s.top_p,
                        stop_token_ids=self.stop_token_ids,
                    )
                )
                self.running += 1
                n += 1
        self.counters["admitted_groups"] += n
        return n

    # ---- 2. rewards -------------------------------------------------------------------------------
    def _drain_sampler(self) -> int:
        n = 0
        while True:
            c = self.sampler.get_completion(timeout=0.0 if n else 0.005)
            if c is None:
                return n
            n += 1
            self.counters["completions"] += 1
            self.counters[f"finish_{c.finish_reason}"] += 1
            key = (c.request_id, c.sample_index)
            if self.turns is not None:
                from areal_jax.sampler.turns import continuation_id

                key = continuation_id(c.request_id) or key
                if c.finish_reason != "error":
                    example = self._groups[key[0]]["example"]
                    if self.turns.add(key, c, list(example.prompt_tokens), example.answer):
                        self._score(key, *self.turns.final(key))
                    continue
                self.turns.discard(key)
            self._score(key, c, list(np.asarray(c.tokens)))

    def _drain_turns(self) -> int:
        """Samples whose execution feedback arrived: scored when final, else sent back to the sampler."""
        finals, requests = self.turns.poll()
        for key in finals:
            self._score(key, *self.turns.final(key))
        for request in requests:
            self.sampler.submit(request)
        return len(finals) + len(requests)

    def _score(self, key: tuple, c, scored_tokens: list[int]) -> None:
        """Sample ``key`` is final: keep its completion and score ``scored_tokens`` (its last turn's) as text."""
        gid, idx = key
        rec = self._groups[gid]
        rec["completions"][idx] = c
        if c.finish_reason == "error":
            self._record_reward(gid, idx, 0.0, "sampler_error")
        else:
            self.rewards.submit((gid, idx), self.decode(scored_tokens), rec["example"].answer)

    def _drain_rewards(self) -> int:
        results = self.rewards.results(timeout=0.0)
        for r in results:
            if self.timeline is not None:  # the time the reward function ran in its worker
                self.timeline.complete("reward", r.seconds, lane="rewards", status=r.status)
            gid, idx = r.key
            self._record_reward(gid, idx, float(r.reward), r.status)
        return len(results)

    # ---- 3. assembly ------------------------------------------------------------------------------
    def _shaped_rewards(self, rewards: np.ndarray, completions: list) -> np.ndarray:
        """The rewards the advantages (and a critic) see: plus DAPO's overlong penalty
        (rl.advantages.overlong_penalty over the completion lengths) when rollout.overlong_buffer > 0."""
        if self.s.overlong_buffer <= 0:
            return rewards
        lengths = np.array([len(c.tokens) for c in completions], np.int32)
        penalty = overlong_penalty(lengths, self.s.max_new_tokens, self.s.overlong_buffer, self.s.overlong_penalty)
        return (rewards + np.asarray(penalty, np.float32)).astype(np.float32)

    def _record_reward(self, gid: int, idx: int, reward: float, status: str) -> None:
        rec = self._groups[gid]
        rec["rewards"][idx] = reward
        rec["status"][idx] = status
        self.counters[f"reward_{status}"] += 1
        if any(r is None for r in rec["rewards"]) or any(c is None for c in rec["completions"]):
            return
        rewards = np.asarray(rec["rewards"], np.float32)
        shaped = self._shaped_rewards(rewards, rec["completions"])
        if self.turns is None:
            adv, token_adv = group_advantages(shaped, self.s.group_size, mode=self.s.advantage_mode), None
        else:  # first attempts and later turns credited apart (sampler.turns.turn_advantages)
            from areal_jax.sampler.turns import turn_advantages

            adv, token_adv = turn_advantages(shaped, rec["completions"], self.s.group_size, self.s.advantage_mode)
            repaired = [r for c, r in zip(rec["completions"], rewards) if getattr(c, "turns", None) is not None]
            self.counters["feedback_repairs"] += len(repaired)
            self.counters["feedback_repaired"] += sum(r >= 1.0 for r in repaired)  # a repair that passes every test
        group = Group(
            gid=gid, example=rec["example"], admit_version=rec["version"], completions=rec["completions"],
            rewards=rewards, reward_status=rec["status"], advantages=np.asarray(adv, np.float32),
            shaped_rewards=shaped, token_advantages=token_adv,
        )
        # The raw rewards: a solved task is one every sample solved, whatever the shaping ("sampler_error" is no
        # reward status of "ok", so such a group is no evidence).
        self.retirement.record(rec["example"].uid, rewards, rec["status"])
        if any(c.finish_reason == "error" for c in rec["completions"]):
            group.filtered, group.filter_reason = True, "sampler_error"
        elif self.s.filter_uniform_groups and np.all(rewards == rewards[0]):
            group.filtered, group.filter_reason = True, "uniform_rewards"
        # One step under the lock: a snapshot() never sees the group in neither place (gone from
        # _groups but not yet in the buffer), which would drop its prompt from a checkpoint.
        with self._lock:
            del self._groups[gid]
            self.running -= 1
            if group.filtered:
                self.counters[f"filtered_{group.filter_reason}"] += 1
            else:
                self.accepted += 1
            self.buffer.complete(group)

    # ---- checkpoint support -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What a checkpoint needs, taken atomically with admission (call between updates).

        pending: examples admitted (or queued for re-admission) but not yet handed to the trainer, in
        admission order, so a resumed run regenerates exactly those before drawing new prompts;
        prompts_state: the prompt iterator's state just after the last drawn example; retirement: the retired
        tasks and streaks (TaskRetirement.state()).
        """
        with self._lock:
            pending = []
            for gid in self.buffer.pending_gids():
                if gid in self._groups:
                    pending.append(self._groups[gid]["example"])
                else:
                    group = self.buffer.peek(gid)
                    if group is not None and not group.filtered:
                        pending.append(group.example)
            pending.extend(self._resubmit)
            return {"pending": pending, "prompts_state": self.prompts.get_state(), "counters": dict(self.counters),
                    "retirement": self.retirement.state()}
