"""Task retirement: skip, in later epochs, the tasks whose recent groups all solved them (or none did).

A group whose samples all scored alike has zero advantage under GRPO: its generation costs sampler time and
teaches nothing. On a dataset the run passes over more than once, tasks the policy always solves (or never
does) come back every epoch. With ``rollout.retire_solved = n`` a task is retired once n of its groups in a row
solved it in every sample (reward >= SOLVED); ``rollout.retire_unsolved = n`` retires it once n groups in a row
solved it in no sample. A retired task is skipped when the prompt stream serves it again.

Only evidence counts: a group with a sampler error, or a sample whose reward function crashed, timed out or
returned NaN (reward status other than "ok"), neither extends nor breaks a streak. Groups in flight when their
task retires still train. When every task of this process's shard is retired (a whole pass of the stream
skipped), retirement starts over: the run still trains the total_steps it was asked for, and every process
keeps drawing prompts, so no process waits alone at a collective.

The tasks are keyed by their uid without its epoch ("file:row"), as the report's tasks table is. Each process
keeps its own retirement (its own shard of prompts); the job saves it in the checkpoint meta beside the prompt
stream's position, so a resumed run skips the same tasks.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

SOLVED = 1.0  # a sample solves its task at reward >= 1, the threshold of the accuracy metric


def task_key(uid: str) -> str:
    """The task of an example uid "<file>:<row>:<epoch>": the uid without its epoch."""
    return uid.rsplit(":", 1)[0]


class TaskRetirement:
    """Streaks of all-solved / none-solved groups per task and the tasks they retired.

    solved_after / unsolved_after: groups in a row that retire a task (0: that kind never retires). Thread-safe: the
    controller's thread records and skips while the trainer's thread reads counts() and state().
    """

    def __init__(self, solved_after: int = 0, unsolved_after: int = 0) -> None:
        if solved_after < 0 or unsolved_after < 0:
            raise ValueError(f"retirement streaks must be >= 0 (0 = off), got solved_after={solved_after}, "
                             f"unsolved_after={unsolved_after}.")
        self.solved_after = int(solved_after)
        self.unsolved_after = int(unsolved_after)
        self._streak: dict[str, int] = {}  # > 0: all-solved groups in a row; < 0: none-solved groups in a row
        self.retired: dict[str, str] = {}  # task -> "solved" | "unsolved"
        self.resets = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.solved_after or self.unsolved_after)

    def record(self, uid: str, rewards: Sequence[float], statuses: Sequence[str]) -> str | None:
        """One finished group of task `uid`: its raw rewards and their reward statuses. Returns "solved" or
        "unsolved" when this group retires the task, else None."""
        if not self.enabled or any(s != "ok" for s in statuses):
            return None
        solved = np.asarray(rewards, np.float64) >= SOLVED
        with self._lock:
            return self._record(task_key(uid), solved)

    def _record(self, key: str, solved: np.ndarray) -> str | None:
        if key in self.retired:
            return None
        prev = self._streak.get(key, 0)
        if solved.all():
            streak = max(prev, 0) + 1
        elif not solved.any():
            streak = min(prev, 0) - 1
        else:
            streak = 0
        kind = None
        if self.solved_after and streak >= self.solved_after:
            kind = "solved"
        elif self.unsolved_after and -streak >= self.unsolved_after:
            kind = "unsolved"
        if kind is not None:
            self.retired[key] = kind
            self._streak.pop(key, None)
        elif streak:
            self._streak[key] = streak
        else:
            self._streak.pop(key, None)
        return kind

    def is_retired(self, uid: str) -> bool:
        if not (self.enabled and self.retired):
            return False
        with self._lock:
            return task_key(uid) in self.retired

    def start_over(self) -> None:
        """Every task is retired: forget the retirements and streaks (counted in `resets`)."""
        with self._lock:
            self._streak.clear()
            self.retired.clear()
            self.resets += 1

    def counts(self) -> dict[str, int]:
        """Tasks retired now, by kind, and how many times retirement started over."""
        with self._lock:
            solved = sum(kind == "solved" for kind in self.retired.values())
            return {"retired_solved": solved, "retired_unsolved": len(self.retired) - solved,
                    "retirement_resets": self.resets}

    def state(self) -> dict:
        """JSON-serialisable; `load_state` restores it exactly. Streaks of 0 are not stored."""
        with self._lock:
            return {"solved_after": self.solved_after, "unsolved_after": self.unsolved_after,
                    "streaks": dict(self._streak), "retired": dict(self.retired), "resets": self.resets}

    def load_state(self, state: dict | None) -> None:
        """Restore `state()` output (None: a checkpoint from before retirement existed; nothing retired). The
        streak lengths of this run's config apply from here on: a task whose saved streak already reaches them
        retires at its next counted group, and the tasks retired by a kind this run turned off (0) are back."""
        streaks, retired, resets = {}, {}, 0
        if state is not None:
            streaks, retired, resets = self._parse(state)
        on = {"solved": self.solved_after > 0, "unsolved": self.unsolved_after > 0}
        with self._lock:
            self._streak = streaks
            self.retired = {k: kind for k, kind in retired.items() if on[kind]}
            self.resets = resets

    @staticmethod
    def _parse(state: dict) -> tuple[dict[str, int], dict[str, str], int]:
        try:
            streaks = {str(k): int(v) for k, v in state["streaks"].items()}
            retired = {str(k): str(v) for k, v in state["retired"].items()}
            resets = int(state.get("resets", 0))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"Not a task-retirement state (expected TaskRetirement.state() output): "
                             f"{state!r:.200}") from e
        bad = sorted(set(retired.values()) - {"solved", "unsolved"})
        if bad:
            raise ValueError(f"Not a task-retirement state: retirement kinds {bad} (expected solved / unsolved).")
        return streaks, retired, resets
