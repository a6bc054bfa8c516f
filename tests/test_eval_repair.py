"""Repair turns in the evaluation (eval.feedback_turns, `evaluate --feedback_turns`): a sequence whose first attempt
fails its shown cases goes back with the feedback, greedy ones stay greedy, and the figures of first and last attempts
follow from what was scored. References: greedy decoding by full forward passes over the prompt, the first attempt and
the feedback; a one-turn evaluation of the same prompts."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from flax import nnx

from areal_jax.config import ConfigError, JobConfig
from areal_jax.data import PromptExample
from areal_jax.evaluation.batch import eval_engine, generate_for_eval, generated_tokens
from areal_jax.evaluation.scoring import EvalConfig, evaluate_examples
from areal_jax.sampler.requests import Completion
from areal_jax.sampler.turns import FeedbackTurns, attempt_tokens
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import full_forward_logp, greedy_reference

CFG = testing.tiny_config("qwen2")
STOP = tuple(range(2, 10))  # 8 of 97 ids end a turn, so most sequences stop inside their budget
MAX_LEN = 64
MAX_NEW = 20
SHOWN = [11, 12, 13]  # the feedback's tokens


class _Tokenizer:
    eos_token_ids = STOP

    @staticmethod
    def decode(tokens):
        return " ".join(str(int(t)) for t in tokens)

    @staticmethod
    def encode(text):
        return [int(t) for t in text.split()]


def _feedback(text, answer):
    """A shown case passes when the attempt has an even number of tokens; else the feedback reads "11 12 13"."""
    return len(text.split()) % 2 == 0, " ".join(map(str, SHOWN))


def _repair(turns=1):
    return functools.partial(FeedbackTurns, turns=turns, template="{feedback}", encode=_Tokenizer.encode,
                             decode=_Tokenizer.decode, feedback=_feedback, workers=1)


@pytest.fixture(scope="module")
def model():
    return testing.random_model(CFG, seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [list(rng.integers(10, CFG.vocab_size, size=int(n))) for n in (3, 7, 12, 5, 20, 9, 4, 15)]


def test_attempt_tokens_of_one_and_several_turns():
    one = Completion("a", 0, [1], np.array([4, 5, 6], np.int32), np.zeros(3, np.float32), np.zeros(3, np.int32), "stop")
    np.testing.assert_array_equal(attempt_tokens(one, 0), [4, 5, 6])
    np.testing.assert_array_equal(attempt_tokens(one, -1), [4, 5, 6])
    with pytest.raises(IndexError):
        attempt_tokens(one, 1)
    # attempt 0: 4 5; feedback 9 9 (counted with attempt 1); attempt 1: 6; feedback 8; attempt 2: 7 3
    many = Completion("a", 0, [1], np.array([4, 5, 9, 9, 6, 8, 7, 3], np.int32), np.zeros(8, np.float32),
                      np.zeros(8, np.int32), "stop", loss_mask=np.array([1, 1, 0, 0, 1, 0, 1, 1], np.float32),
                      turns=np.array([0, 0, 1, 1, 1, 2, 2, 2], np.int32))
    assert [list(attempt_tokens(many, t)) for t in (0, 1, 2, -1)] == [[4, 5], [6], [7, 3], [7, 3]]
    assert generated_tokens(many) == 5 and generated_tokens(one) == 3


@pytest.mark.parametrize("streams", [1, 2])
def test_greedy_repairs_equal_a_full_forward_reference_and_samples_carry_their_logprobs(model, prompts, streams):
    k = 2
    engine = eval_engine(model, num_slots=6, max_len=MAX_LEN, num_sequences=len(prompts) * (1 + k), streams=streams,
                         max_stop_tokens=len(STOP))
    gen = generate_for_eval(engine, nnx.state(model), prompts, k=k, temperature=1.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=STOP, seed=2, streams=streams, repair=_repair(), answers=[""] * len(prompts))
    logp = full_forward_logp(model, MAX_LEN)
    repaired = 0
    for i, p in enumerate(prompts):
        first = greedy_reference(logp, p, MAX_NEW, stop=STOP)[0]
        c = gen.greedy[i]
        if first[-1] not in STOP or len(first) % 2 == 0:  # ran out of budget, or passed: one turn
            assert list(c.tokens) == first and c.turns is None and c.loss_mask is None, f"prompt {i}"
            continue
        repaired += 1
        context = list(p) + first + SHOWN
        budget = min(MAX_NEW - len(first) - len(SHOWN), MAX_LEN - len(context))
        second = greedy_reference(logp, context, budget, stop=STOP)[0] if budget >= 1 else []
        assert list(c.tokens) == first + SHOWN + second, f"prompt {i}"
        assert list(c.loss_mask) == [1] * len(first) + [0] * len(SHOWN) + [1] * len(second)
        assert list(c.turns) == [0] * len(first) + [1] * (len(SHOWN) + len(second))
        assert list(attempt_tokens(c, -1)) == second
    assert 0 < repaired < len(prompts)  # both kinds of greedy sequence were checked
    for i, p in enumerate(prompts):
        for c in gen.sampled[i]:  # temperature 1: each generated token's log-probability is the model's
            seq, mask = list(p), np.ones(len(c.tokens)) if c.loss_mask is None else c.loss_mask
            for tok, lp, m in zip(c.tokens, c.logprobs, mask):
                if m:
                    np.testing.assert_allclose(lp, logp(seq)[-1][tok], atol=2e-4)
                seq.append(int(tok))
            assert len(c.tokens) - len(SHOWN) * int(c.turns is not None) <= MAX_NEW
    assert any(c.turns is not None for row in gen.sampled for c in row)
    assert gen.generated_tokens == sum(generated_tokens(c) for c in gen.greedy) + sum(
        generated_tokens(c) for row in gen.sampled for c in row)


def test_more_turns_stop_at_the_limit_or_a_pass(model, prompts):
    engine = eval_engine(model, num_slots=8, max_len=MAX_LEN, num_sequences=len(prompts), max_stop_tokens=len(STOP))
    gen = generate_for_eval(engine, nnx.state(model), prompts, k=0, temperature=1.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=STOP, repair=_repair(turns=3), answers=[""] * len(prompts))
    for c in gen.greedy:
        attempts = 1 if c.turns is None else int(c.turns.max()) + 1
        assert attempts <= 4
        for t in range(attempts - 1):  # every attempt but the last stopped with an odd length: it failed
            tokens = attempt_tokens(c, t)
            assert tokens[-1] in STOP and len(tokens) % 2 == 1
    with pytest.raises(ValueError, match="answers"):
        generate_for_eval(engine, nnx.state(model), prompts, k=0, temperature=1.0, max_new_tokens=MAX_NEW,
                          repair=_repair())


class _FirstTokenPool:
    """Stands in for a RewardPool: a text is correct when its first token is even."""

    def __init__(self):
        self.rewards, self.texts = {}, {}

    def score_batch(self, items):
        from areal_jax.rewards.pool import RewardResult

        out = []
        for key, text, _ in items:
            ok = bool(text) and int(text.split()[0]) % 2 == 0
            self.rewards[key], self.texts[key] = ok, text
            out.append(RewardResult(key=key, reward=float(ok), status="ok", error=None, seconds=0.0))
        return out


def test_first_and_last_attempt_figures_follow_from_what_was_scored(model, prompts):
    k = 3
    examples = [PromptExample(uid=str(i), prompt_tokens=list(p), answer="", question="") for i, p in enumerate(prompts)]
    kw = dict(max_new_tokens=MAX_NEW, k=k, temperature=1.0, num_slots=12, max_len=MAX_LEN, seed=4, records=True)
    one = evaluate_examples(model, _Tokenizer(), examples, pool=_FirstTokenPool(), **kw)
    pool = _FirstTokenPool()
    res = evaluate_examples(model, _Tokenizer(), examples, pool=pool, repair=_repair(), **kw)
    assert res["greedy_pass@1"] == one["greedy_pass@1"]  # the greedy first attempts are the one-turn sequences
    n = len(prompts)
    repaired = {key for key in pool.rewards if key[0].startswith("first_")}
    assert repaired, "no sequence got a repair turn"

    def first(kind, i, j):
        return pool.rewards.get(("first_" + kind, i, j), pool.rewards[(kind, i, j)])

    assert res["greedy_pass@1"] == pytest.approx(np.mean([first("greedy", i, 0) for i in range(n)]))
    assert res["repair_greedy_pass@1"] == pytest.approx(np.mean([pool.rewards[("greedy", i, 0)] for i in range(n)]))
    assert res["sampled_pass@1"] == pytest.approx(np.mean([first("sampled", i, j) for i in range(n) for j in range(k)]))
    assert res["repair_sampled_pass@1"] == pytest.approx(
        np.mean([pool.rewards[("sampled", i, j)] for i in range(n) for j in range(k)]))
    assert res[f"repair_pass@{k}"] == pytest.approx(
        np.mean([any(pool.rewards[("sampled", i, j)] for j in range(k)) for i in range(n)]))
    assert res["repair_share"] == pytest.approx(len(repaired) / (n * (1 + k)))
    fixed = [pool.rewards[key[0][len("first_"):], *key[1:]] for key in repaired]
    assert res["repair_fixed"] == pytest.approx(np.mean(fixed))
    for key in repaired:  # what was scored as a first attempt is one that failed its shown case (odd length, stopped)
        tokens = [int(t) for t in pool.texts[key].split()]
        assert len(tokens) % 2 == 1 and tokens[-1] in STOP
    records = res["problems"]
    assert [r["greedy_reward"] for r in records] == [float(pool.rewards[("greedy", i, 0)]) for i in range(n)]
    assert [r["greedy_first_reward"] for r in records] == [float(first("greedy", i, 0)) for i in range(n)]
    assert [r["correct_first"] for r in records] == [sum(first("sampled", i, j) for j in range(k)) for i in range(n)]


def test_eval_feedback_turns_follow_the_rollout_and_need_the_code_reward():
    assert EvalConfig().feedback_turns_for(2) == 2
    assert EvalConfig(feedback_turns=0).feedback_turns_for(2) == 0
    assert EvalConfig(feedback_turns=3).feedback_turns_for(0) == 3
    with pytest.raises(ConfigError, match="feedback_turns=-2"):
        EvalConfig(feedback_turns=-2)
    with pytest.raises(ConfigError, match="eval.feedback_turns=1 .*reward.fn=code"):
        JobConfig(eval=EvalConfig(feedback_turns=1))
