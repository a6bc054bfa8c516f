"""Task retirement (system/retire.py): streaks worked by hand, and the controller skipping retired tasks of a real
multi-epoch prompt stream, resumed from a snapshot exactly as an uninterrupted run."""
import collections
import json

import numpy as np
import pytest

from areal_jax.config import ConfigError
from areal_jax.data import make_prompt_iterator
from areal_jax.data.math_tokenizer import build_math_tokenizer
from areal_jax.sampler.config import RolloutConfig
from areal_jax.system.buffer import TrajectoryBuffer
from areal_jax.system.controller import RolloutController
from areal_jax.system.retire import TaskRetirement, task_key
from areal_jax.testing.fakes import FakeCompletion, QueuedCompletions, RuleRewards

OK4 = ["ok"] * 4


def test_streaks_by_hand():
    r = TaskRetirement(solved_after=2, unsolved_after=3)
    assert r.record("a.jsonl:1:0", [1, 1, 1, 1], OK4) is None  # one all-solved group: streak 1
    assert r.record("a.jsonl:1:1", [1, 0, 1, 1], OK4) is None  # a mixed group breaks it
    assert r.record("a.jsonl:1:2", [1, 1, 1, 1], OK4) is None
    assert r.record("a.jsonl:1:3", [1.0, 1.5, 1, 1], OK4) == "solved"  # two in a row; reward >= 1 solves
    assert r.is_retired("a.jsonl:1:7") and not r.is_retired("a.jsonl:10:0")
    assert r.record("a.jsonl:1:4", [0, 0, 0, 0], OK4) is None  # a retired task's late group changes nothing
    for epoch, kind in enumerate([None, None, "unsolved"]):  # 0.99 is not solved
        assert r.record(f"b:2:{epoch}", [0, 0.99, -1, 0], OK4) == kind
    # A crashed, timed-out or NaN reward is no evidence: the streak neither grows nor breaks.
    assert r.record("c:3:0", [1, 1, 1, 1], OK4) is None
    assert r.record("c:3:1", [1, 1, 1, 0], ["ok", "ok", "ok", "timeout"]) is None
    assert r.record("c:3:2", [1, 1, 1, 1], OK4) == "solved"
    assert r.counts() == {"retired_solved": 2, "retired_unsolved": 1, "retirement_resets": 0}
    r.start_over()
    assert not r.is_retired("a.jsonl:1:9") and r.counts()["retirement_resets"] == 1


def test_off_by_default_and_state_round_trip():
    off = TaskRetirement()
    assert off.record("a:1:0", [1] * 4, OK4) is None and not off.enabled and off.retired == {}
    r = TaskRetirement(solved_after=2, unsolved_after=2)
    r.record("a:1:0", [1] * 4, OK4)
    r.record("b:1:0", [0] * 4, OK4)
    r.record("b:1:1", [0] * 4, OK4)
    state = json.loads(json.dumps(r.state()))  # what a checkpoint's meta holds
    back = TaskRetirement(solved_after=2, unsolved_after=2)
    back.load_state(state)
    assert back.state() == r.state()
    assert back.record("a:1:1", [1] * 4, OK4) == "solved"  # the saved streak of 1 continues
    only_solved = TaskRetirement(solved_after=2)  # a resume that turned unsolved retirement off gets b back
    only_solved.load_state(state)
    assert not only_solved.is_retired("b:1:5")
    disabled = TaskRetirement()
    disabled.load_state(state)
    assert not disabled.is_retired("b:1:5")
    with pytest.raises(ValueError, match="Not a task-retirement state"):
        back.load_state({"streaks": {}, "retired": {"x": "easy"}})
    with pytest.raises(ValueError, match="Not a task-retirement state"):
        back.load_state({"retired": []})
    with pytest.raises(ValueError, match="must be >= 0"):
        TaskRetirement(solved_after=-1)


def test_config_rejects_negative_streaks():
    with pytest.raises(ConfigError, match="retire_solved"):
        RolloutConfig(retire_solved=-1).check()


class InstantSampler(QueuedCompletions):
    """Finishes every sample of a request as soon as it is submitted."""

    def submit(self, req):
        for i in range(req.n):
            self.out.put(FakeCompletion(req.id, i, np.arange(3), np.zeros(3), np.zeros(3, np.int32)))


ANSWERS = {"easy": (100, 101, 102), "hard": (103, 104), "mixed": (105, 106)}


def _rule(key, text, answer):
    """Every sample solves an easy task, none a hard one, every other sample a mixed one."""
    kind = next(k for k, answers in ANSWERS.items() if int(answer) in answers)
    return {"easy": 1.0, "hard": 0.0, "mixed": float(key[1] % 2)}[kind]


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("retire") / "tasks.jsonl"
    with open(path, "w") as f:
        for answer in sorted(a for answers in ANSWERS.values() for a in answers):
            f.write(json.dumps({"question": f"Tom has {answer} apples. How many apples?", "answer": str(answer)}) + "\n")
    return str(path)


def _controller(train_file, solved=2, unsolved=3, snapshot=None, rule=_rule):
    prompts = make_prompt_iterator(train_file, build_math_tokenizer(), seed=1, process_index=0, process_count=1)
    if snapshot is not None:
        prompts.set_state(snapshot["prompts_state"])
    cfg = RolloutConfig(group_size=4, max_new_tokens=8, max_staleness=0, retire_solved=solved, retire_unsolved=unsolved)
    return RolloutController(cfg, InstantSampler(), RuleRewards(rule), prompts, lambda t: "x", TrajectoryBuffer(),
                             batch_groups=1, retirement=None if snapshot is None else snapshot["retirement"])


def _drive(ctl, groups):
    """eta = 0 and one group a batch: each group is scored (and may retire its task) before the next is drawn."""
    admitted = []
    for version in range(groups):
        ctl.sampler.current_version = version
        assert ctl._admit() == 1
        ctl._drain_sampler()
        ctl._drain_rewards()
        (group,) = ctl.buffer.get_batch(1, timeout=1.0)
        admitted.append(group.example.uid)
    return admitted


def test_controller_skips_retired_tasks_of_a_multi_epoch_stream(train_file):
    ctl = _controller(train_file)
    admitted = _drive(ctl, 7 + 7 + 4 + 2 + 2)  # epochs 0-1 whole, epoch 2 without easy tasks, then mixed only
    per_task = collections.Counter(task_key(uid) for uid in admitted)
    answer_of = {f"tasks.jsonl:{row}": 99 + row for row in range(1, 8)}  # rows are 1-based
    for task, n in per_task.items():
        kind = next(k for k, answers in ANSWERS.items() if answer_of[task] in answers)
        assert n == {"easy": 2, "hard": 3, "mixed": 5}[kind], (task, n, admitted)
    assert len(per_task) == 7
    assert ctl.retirement.counts() == {"retired_solved": 3, "retired_unsolved": 2, "retirement_resets": 0}
    draws = ctl.prompts.next_index
    assert ctl.counters["skipped_retired"] == draws - len(admitted) > 0


def test_resume_from_a_snapshot_skips_the_same_tasks(train_file):
    whole = _drive(_controller(train_file), 25)
    first = _controller(train_file)
    head = _drive(first, 16)  # two epochs and two groups: the easy tasks are retired by now
    snap = json.loads(json.dumps({k: v for k, v in first.snapshot().items() if k in ("prompts_state", "retirement")}))
    assert sum(kind == "solved" for kind in snap["retirement"]["retired"].values()) == 3
    assert head + _drive(_controller(train_file, snapshot=snap), 9) == whole


def test_every_task_retired_starts_over(train_file):
    ctl = _controller(train_file, solved=1, rule=lambda key, text, answer: 1.0)  # every task retires at once
    admitted = _drive(ctl, 7 + 7)
    assert sorted(task_key(u) for u in admitted[:7]) == sorted(f"tasks.jsonl:{row}" for row in range(1, 8))
    # Epoch 1 is skipped whole (every task retired), so retirement starts over and epoch 2 is trained.
    assert [u.rsplit(":", 1)[1] for u in admitted] == ["0"] * 7 + ["2"] * 7
    assert ctl.counters["skipped_retired"] == 7
    assert ctl.retirement.counts() == {"retired_solved": 7, "retired_unsolved": 0, "retirement_resets": 1}


def test_the_trainer_thread_reads_while_the_controller_thread_records():
    """The controller's thread records groups while the job's thread saves state() and logs counts(): every read
    sees a consistent snapshot (a dict copied while another thread resizes it would raise)."""
    import threading

    r = TaskRetirement(solved_after=1, unsolved_after=1)
    done, errors, reads = threading.Event(), [], []

    def record():
        for i in range(8_000):
            r.record(f"t:{i}:0", [1] * 4 if i % 3 else [0] * 4, OK4)
            if i % 2000 == 1999:
                r.start_over()
        done.set()

    def read():
        try:
            while not done.is_set():
                state = r.state()
                reads.append(len(state["retired"]))
                assert set(r.counts()) == {"retired_solved", "retired_unsolved", "retirement_resets"}
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=record), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and reads and r.resets == 4
    assert r.counts() == {"retired_solved": 0, "retired_unsolved": 0, "retirement_resets": 4}
