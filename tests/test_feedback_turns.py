"""Multi-turn code rollouts with execution feedback: the feedback text (worked by hand for each kind of failure), and
the controller's turns against a scripted sampler: continuation prompts and budgets, the merged completion (every
turn and feedback, feedback out of the loss), what the reward scores, and the turn limit."""
import json
import threading
import time

import numpy as np
import pytest

from areal_jax.config import ConfigError, JobConfig
from areal_jax.rewards.code_feedback import NO_PROGRAM, code_feedback
from areal_jax.rewards.code_tests import TestSpec, asserts_to_spec, encode_tests
from areal_jax.sampler.config import RolloutConfig
from areal_jax.sampler.turns import FeedbackTurns, continuation_id, turn_advantages
from areal_jax.system.buffer import TrajectoryBuffer
from areal_jax.system.controller import RolloutController
from areal_jax.system.runner import groups_to_trajectories
from areal_jax.testing.fakes import FakeCompletion, FakeExample, QueuedCompletions, RuleRewards
from areal_jax.testing.prompts import ListPrompts

ADD = encode_tests(TestSpec(stdio=(("1 2\n", "3\n"), ("5 5\n", "10\n"))))
DIGITS = encode_tests(asserts_to_spec(["assert f(58) == 13", "assert f(0) == 0"]))


def _block(program):
    return f"```python\n{program}\n```"


@pytest.mark.parametrize("program, answer, kwargs, expected", [
    ("a, b = map(int, input().split())\nprint(a + b)", ADD, {}, (True, "")),
    ("a, b = map(int, input().split())\nprint(a * b)", ADD, {},
     (False, "On the input\n1 2\nthe expected output is\n3\nbut your program printed\n2")),
    ("a, b = map(int, input().split())\nprint(a * b)", ADD, {"cases": 0},  # at least one case is shown
     (False, "On the input\n1 2\nthe expected output is\n3\nbut your program printed\n2")),
    ("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)", ADD, {"cases": 2},
     (False, "On the input\n5 5\nthe expected output is\n10\nbut your program printed\n0")),
    ("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)", ADD, {"cases": 1}, (True, "")),  # case 2 unseen
    ("x = 1\ny = x / 0", ADD, {},
     (False, "On the input\n1 2\nyour program failed: ZeroDivisionError: division by zero (line 2 of your program)")),
    ("while True:\n    pass", ADD, {"case_timeout_s": 1.0},
     (False, "On the input\n1 2\nyour program ran past the 1 s time limit.")),
    ("def f(x):\n    return sum(map(int, str(x)))", DIGITS, {"cases": 2}, (True, "")),
    ("def f(x):\n    return x * 2", DIGITS, {}, (False, "f(58) returned 116, expected 13.")),
    ("def f(x):\n    return [x]", DIGITS, {}, (False, "f(58) returned [58], expected 13.")),
    ("import os\nos.fork()\ndef f(x):\n    return 13", DIGITS, {},  # a program run alone gets no processes
     (False, "Calling f(58)\nyour program failed: PermissionError: [Errno 1] Operation not permitted "
             "(line 2 of your program)")),
])
def test_feedback_says_what_the_first_failing_shown_case_did(program, answer, kwargs, expected):
    assert code_feedback(_block(program), answer, **kwargs) == expected


def test_feedback_on_opaque_tests_and_setup_lines_and_no_program():
    opaque = encode_tests(asserts_to_spec(["assert f(58) > 10"], setup="import math"))
    assert code_feedback(_block("def f(x):\n    return 1"), opaque) == (
        False, "On the test\nassert f(58) > 10\nyour program failed: AssertionError")
    assert code_feedback(_block("def f(x):\n    return 1 / 0"), opaque) == (  # the setup's line is not the program's
        False, "On the test\nassert f(58) > 10\nyour program failed: ZeroDivisionError: division by zero "
               "(line 2 of your program)")
    assert code_feedback("```\n```", DIGITS) == code_feedback("", DIGITS) == (False, NO_PROGRAM)
    assert code_feedback("I cannot write this.", DIGITS) == (  # prose runs as a program, as the reward runs it
        False, "Calling f(58)\nyour program failed: SyntaxError: invalid syntax (line 1 of your program)")


# ---- the controller's turns, against a scripted sampler ----
EOS = 2
GOOD, BAD = [5, 6, EOS], [7, 8, EOS]  # a program the feedback passes, one it does not


class ScriptedSampler(QueuedCompletions):
    """First turns: sample i of each group writes GOOD when i is even, else BAD; every continuation writes GOOD, or
    BAD while ``stubborn``. Versions: the number of requests seen so far (so turns differ)."""

    def __init__(self, stubborn=False, first=None):
        super().__init__()
        self.requests, self.stubborn, self.first = [], stubborn, first
        self.lock = threading.Lock()

    def submit(self, req):
        with self.lock:
            self.requests.append(req)
            version = len(self.requests)
            for i in range(req.n):
                if continuation_id(req.id) is None:
                    tokens = self.first(i) if self.first else (GOOD if i % 2 == 0 else BAD)
                else:
                    tokens = BAD if self.stubborn else GOOD
                tokens = tokens[:req.max_new_tokens]
                finish = "stop" if tokens and tokens[-1] == EOS else "length"
                self.out.put(FakeCompletion(req.id, i, np.asarray(tokens), np.full(len(tokens), -0.5),
                                            np.full(len(tokens), version), finish))


def _decode(tokens):
    return "good" if list(tokens) == GOOD else "bad"


def _encode(text):  # feedback text -> tokens: 3 tokens of 90+, whatever the text
    return [90, 91, 92]


def _turns(turns=1, max_new_tokens=32, max_len=64):
    return FeedbackTurns(turns=turns, template="\n{feedback}\n", encode=_encode, decode=_decode,
                         feedback=lambda text, answer: (text == "good", "fix it"), max_new_tokens=max_new_tokens,
                         max_len=max_len, workers=2, request={"stop_token_ids": (EOS,)})


def _collect(sampler, turns, groups=2, group_size=2, max_new_tokens=32, timeline=None):
    scored = []
    rewards = RuleRewards(lambda key, text, answer: scored.append((key, text)) or float(text == "good"))
    buffer = TrajectoryBuffer()
    settings = RolloutConfig(group_size=group_size, max_new_tokens=max_new_tokens, max_len=64, max_staleness=4)
    prompts = ListPrompts(FakeExample(f"p{i}", [1, 3, 4], "tests") for i in range(groups))
    ctl = RolloutController(settings, sampler, rewards, prompts, _decode, buffer, batch_groups=groups,
                            turns=turns, timeline=timeline).start()
    try:
        got = None
        for _ in range(2000):
            got = buffer.get_batch(groups, timeout=0.005)
            ctl.check()
            if got is not None:
                break
        assert got is not None, "no batch"
    finally:
        ctl.stop()
    return got, scored, ctl


def test_a_failing_turn_goes_back_with_feedback_and_comes_out_as_one_masked_completion():
    from areal_jax.timeline import Timeline

    sampler, timeline = ScriptedSampler(), Timeline(max_buffered=1000)
    groups, scored, ctl = _collect(sampler, _turns(turns=1), timeline=timeline)
    continuations = [r for r in sampler.requests if continuation_id(r.id) is not None]
    assert len(continuations) == 2  # the odd sample of each group
    for r in continuations:
        assert r.prompt == [1, 3, 4] + BAD + [90, 91, 92] and r.n == 1
        assert r.max_new_tokens == 32 - len(BAD) - 3 and tuple(r.stop_token_ids) == (EOS,)
    for g in groups:
        good, fixed = g.completions
        assert list(good.tokens) == GOOD and good.loss_mask is None  # passed at once: one turn
        assert list(fixed.tokens) == BAD + [90, 91, 92] + GOOD
        np.testing.assert_array_equal(fixed.loss_mask, [1, 1, 1, 0, 0, 0, 1, 1, 1])
        np.testing.assert_array_equal(fixed.turns, [0, 0, 0, 1, 1, 1, 1, 1, 1])  # feedback: with the attempt after it
        np.testing.assert_array_equal(fixed.logprobs, [-0.5] * 3 + [0.0] * 3 + [-0.5] * 3)
        assert fixed.versions[3] == fixed.versions[2] < fixed.versions[6]  # feedback keeps the turn's version
        assert list(g.rewards) == [1.0, 1.0]
    assert sorted(text for _, text in scored) == ["good"] * 4  # the reward sees the last turn only
    # feedback ran on the four first turns (two passed); the last allowed turn is final without it
    assert (ctl.counters["feedback_runs"], ctl.counters["feedback_passed"], ctl.counters["feedback_turns"]) == (4, 2, 2)
    assert (ctl.counters["feedback_repairs"], ctl.counters["feedback_repaired"]) == (2, 2)
    assert sum(e["name"] == "feedback" for e in timeline.events()) == 4  # each run a span in the trace
    trajectories = groups_to_trajectories(groups)
    masked = [t for t in trajectories if t.loss_mask is not None]
    assert len(masked) == 2 and all(t.completion_mask().sum() == 6 for t in masked)
    # Credit: both samples end with reward 1 (final advantages 0), but the fixed one's first attempt failed a shown
    # case, so among first attempts (1 and 0) it is the worse: its first-turn tokens are pushed down, the fix is not.
    for t in masked:
        np.testing.assert_allclose(t.completion_advantages(), [-1.0] * 3 + [0.0] * 6, atol=1e-5)
    assert all(t.token_advantages is None and t.advantage == pytest.approx(1.0, abs=1e-5)
               for t in trajectories if t.loss_mask is None)
    assert all(len(t.tokens) == 3 + len(t.behav_logp) for t in trajectories)


def test_a_multi_turn_samples_routes_are_each_positions_first():
    """With recorded routes, each position keeps the experts of the forward that first computed it: the prompt's and
    the first attempt's from the first turn, the feedback's (the second turn's prefill) and the fix's from the second;
    a turn without routes leaves the sample without any."""
    from areal_jax.sampler.requests import Completion

    def turn(prompt, tokens, marker):
        routes = np.full((len(prompt) + len(tokens), 2, 2), marker, np.int32)
        return Completion("r", 0, prompt, np.asarray(tokens, np.int32), np.full(len(tokens), -0.5, np.float32),
                          np.zeros(len(tokens), np.int32), "stop", routes=routes)

    for second_has_routes in (True, False):
        turns = _turns(turns=1)
        try:
            assert not turns.add(("r", 0), turn([1, 3, 4], BAD, 1), [1, 3, 4], "")
            for _ in range(2000):
                finals, requests = turns.poll()
                if requests:
                    break
                time.sleep(0.005)
            [req] = requests
            assert req.prompt == [1, 3, 4] + BAD + [90, 91, 92]
            second = turn(list(req.prompt), GOOD, 2)
            if not second_has_routes:
                second.routes = None
            assert turns.add(("r", 0), second, [1, 3, 4], "")
            merged, _ = turns.final(("r", 0))
        finally:
            turns.close()
        if second_has_routes:
            assert merged.routes.shape == (3 + 9, 2, 2)
            np.testing.assert_array_equal(merged.routes[:, 0, 0], [1] * 6 + [2] * 6)
        else:
            assert merged.routes is None


def test_the_turn_limit_and_the_token_budget_end_a_sample():
    sampler = ScriptedSampler(stubborn=True)
    groups, scored, ctl = _collect(sampler, _turns(turns=2), groups=1)
    stubborn = groups[0].completions[1]
    assert list(stubborn.tokens) == (BAD + [90, 91, 92]) * 2 + BAD  # three turns, then final whatever the feedback
    assert groups[0].rewards[1] == 0.0 and ctl.counters["feedback_turns"] == 2
    # a budget too small for feedback and another turn: final after the first turn
    sampler = ScriptedSampler(stubborn=True)
    groups, _, ctl = _collect(sampler, _turns(turns=3, max_new_tokens=6), groups=1, max_new_tokens=6)
    assert list(groups[0].completions[1].tokens) == BAD and ctl.counters["feedback_no_room"] == 1
    # a turn cut at its budget (no end of sequence) gets no feedback
    sampler = ScriptedSampler(first=lambda i: [7, 8, 9, 9])
    groups, _, ctl = _collect(sampler, _turns(turns=1), groups=1)
    assert ctl.counters["feedback_runs"] == 0 and all(c.loss_mask is None for c in groups[0].completions)


def test_feedback_turns_are_checked_with_the_config():
    with pytest.raises(ConfigError, match=r"--config\.rollout\.feedback_turns=1 runs each program .* needs "
                                          r"--config\.reward\.fn=code"):
        JobConfig(rollout=RolloutConfig(feedback_turns=1))
    with pytest.raises(ConfigError, match="lacks the '{feedback}' placeholder"):
        RolloutConfig(feedback_turns=1, feedback_template="no placeholder").check()
    with pytest.raises(ConfigError, match="feedback_cases=0 >= 1"):
        RolloutConfig(feedback_cases=0).check()


@pytest.mark.slow
def test_the_code_default_with_a_feedback_turn_trains_on_masked_turns(tmp_path, monkeypatch):
    """The embedded code model (which ends its programs with an end-of-sequence token) for two steps with one
    feedback turn: wrong first programs go back with the sandbox's feedback, the trained trajectories hold turns whose
    feedback tokens are out of the loss, and the update stays finite."""
    import os

    from areal_jax import config as config_lib
    from areal_jax.system import runner
    from areal_jax.system.job import RLJob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c = config_lib.load_config_file(os.path.join(root, "configs", "code.py"))
    for key in ("model.path", "data.train_path", "data.test_path"):
        section, field = key.split(".")
        setattr(getattr(c, section), field, os.path.join(root, getattr(getattr(c, section), field)))
    c.run_dir, c.total_steps, c.eval.n_test = str(tmp_path / "run"), 2, 0
    c.rollout.feedback_turns, c.rollout.feedback_template = 1, "chat"  # the code tokenizer's frame, read off
    c.data.use_chat_template = True  # its chat template renders the same prompts as the plain one
    c.rollout.max_new_tokens, c.rollout.max_len = 120, 208
    c.train.batch_groups, c.rollout.group_size = 4, 4
    c.checkpoint.every_steps = 0
    config_lib.validate(c)
    trained = []
    convert = runner.groups_to_trajectories

    def capture(groups):
        out = convert(groups)
        trained.extend(out)
        return out

    monkeypatch.setattr(runner, "groups_to_trajectories", capture)
    logged = []
    job = RLJob(c, log_fn=lambda *a, **k: logged.append(" ".join(map(str, a))))
    try:
        job.run()
        counters = dict(job.controller.counters)
        decode = job.tokenizer.decode
    finally:
        job.close()
    assert any("feedback framed as 'Question: {feedback}\\nAnswer:'" in line for line in logged), logged
    assert any("loss_agg=seq-mean-token-mean weighs each sequence equally" in line for line in logged)
    assert counters["feedback_runs"] > 0 and counters["feedback_turns"] > 0, counters
    turned = [t for t in trained if t.loss_mask is not None]
    assert turned, "no trajectory with a feedback turn was trained"
    for t in turned:
        mask = t.completion_mask()
        assert 0 < mask.sum() < mask.size and np.all(t.behav_logp[mask == 0] == 0.0)
        shown = decode(t.tokens[t.prompt_len:][mask == 0].tolist())
        assert shown.startswith("Question: ") and shown.endswith("\nAnswer:"), shown
    with open(os.path.join(c.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 2 and np.all(np.isfinite(losses))
    assert rows[-1]["rollout/feedback_turns"] == counters["feedback_turns"]


def test_turn_advantages_worked_by_hand():
    """Five samples, rewards 1, 1, 0, 0, 1; samples 1, 3 and 4 needed a feedback turn. First attempts: 1, 0, 0, 0, 0
    (a first attempt that got feedback failed a shown case); repairs among themselves: 1, 0, 1. GRPO: (r - mean) /
    (std + eps) with the population std."""
    def grpo(r):
        r = np.asarray(r, np.float64)
        return (r - r.mean()) / (r.std() + 1e-6)

    one = FakeCompletion(0, 0, np.arange(3), np.zeros(3), np.zeros(3))
    multi = FakeCompletion(0, 1, np.arange(5), np.zeros(5), np.zeros(5))
    multi.turns = np.array([0, 0, 1, 1, 1])
    completions = [one, multi, one, multi, multi]
    rewards = np.array([1.0, 1.0, 0.0, 0.0, 1.0], np.float32)
    adv, tokens = turn_advantages(rewards, completions, 5, "grpo")
    first, repairs = grpo([1, 0, 0, 0, 0]), grpo([1, 0, 1])
    np.testing.assert_allclose(adv, first, rtol=1e-5)
    assert tokens[0] is None and tokens[2] is None
    for i, j in ((1, 0), (3, 1), (4, 2)):
        np.testing.assert_allclose(tokens[i], [first[i]] * 2 + [repairs[j]] * 3, rtol=1e-5)
    _, alone = turn_advantages(rewards, [one, multi, one, one, one], 5, "rloo")  # one repair: nothing to compare
    np.testing.assert_allclose(alone[1][2:], 0.0)
    single, none = turn_advantages(rewards, [one] * 5, 5, "grpo")  # no multi-turn sample: plain GRPO
    np.testing.assert_allclose(single, grpo(rewards), rtol=1e-5)
    assert none is None
