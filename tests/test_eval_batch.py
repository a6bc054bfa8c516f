"""The one-pass evaluation: its greedy completions equal a one-by-one greedy reference (full forward
passes, no cache, no batching), its sampled completions carry the right behaviour log-probabilities,
and pass@1 / pass@k come out as enumeration over the scored completions gives them."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from flax import nnx

from areal_jax.data import PromptExample
from areal_jax.evaluation.batch import eval_engine, generate_for_eval
from areal_jax.evaluation.scoring import evaluate_examples, pass_at_k
from areal_jax.testing import models as testing
from areal_jax.testing.sampler import full_forward_logp, greedy_reference

CFG = testing.tiny_config("qwen2")
EOS = 2
MAX_LEN = 48
MAX_NEW = 10


@pytest.fixture(scope="module")
def model():
    return testing.random_model(CFG, seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [list(rng.integers(3, CFG.vocab_size, size=int(n))) for n in (3, 7, 12, 5, 20, 9)]


def test_batched_greedy_equals_one_by_one_reference_and_samples_carry_their_logprobs(model, prompts):
    k = 3
    # 8 slots for 6 x (1 + 3) = 24 sequences: slots are reused, greedy and sampled rows decode together.
    engine = eval_engine(model, num_slots=8, max_len=MAX_LEN, num_sequences=len(prompts) * (1 + k))
    gen = generate_for_eval(engine, nnx.state(model), prompts, k=k, temperature=1.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=(EOS,), seed=1)
    logp = full_forward_logp(model, MAX_LEN)

    def next_logp(seq):
        return logp(seq)[-1]

    for i, p in enumerate(prompts):
        assert list(gen.greedy[i].tokens) == greedy_reference(logp, p, MAX_NEW, stop=(EOS,))[0], f"prompt {i}"
        assert len(gen.sampled[i]) == k
        for c in gen.sampled[i]:
            seq = list(p)
            for tok, lp in zip(c.tokens, c.logprobs):  # temperature 1: the raw model distribution
                np.testing.assert_allclose(lp, next_logp(seq)[tok], atol=2e-4)
                seq.append(int(tok))
            assert c.finish_reason == ("stop" if c.tokens[-1] == EOS else "length")
    assert gen.generated_tokens == sum(len(c.tokens) for c in gen.greedy) + sum(
        len(c.tokens) for row in gen.sampled for c in row)
    assert 0 < gen.occupancy <= 1


def test_greedy_does_not_depend_on_slot_count(model, prompts):
    runs = []
    for slots in (1, 64):
        engine = eval_engine(model, num_slots=slots, max_len=MAX_LEN, num_sequences=len(prompts) * 3)
        gen = generate_for_eval(engine, nnx.state(model), prompts, k=2, temperature=0.7, max_new_tokens=MAX_NEW,
                                stop_token_ids=(EOS,), seed=0)
        runs.append([list(c.tokens) for c in gen.greedy])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("streams", [2, 3])
def test_streams_share_the_slots_and_give_the_reference_completions(model, prompts, streams):
    """Several sampler loops on one engine (the job's evaluation on CPU): the engine holds
    ceil(slots / streams) slots per stream, every greedy completion equals the one-by-one reference, every
    sampled completion is there once with the model's log-probabilities, and on_completion sees each
    sequence once."""
    k = 2
    engine = eval_engine(model, num_slots=8, max_len=MAX_LEN, num_sequences=len(prompts) * (1 + k), streams=streams)
    assert engine.num_slots == -(-8 // streams)
    seen = []
    gen = generate_for_eval(engine, nnx.state(model), prompts, k=k, temperature=1.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=(EOS,), seed=4, streams=streams,
                            on_completion=lambda kind, i, j, c: seen.append((kind, i, j)))
    assert sorted(seen) == sorted([("greedy", i, 0) for i in range(len(prompts))]
                                  + [("sampled", i, j) for i in range(len(prompts)) for j in range(k)])
    logp = full_forward_logp(model, MAX_LEN)
    for i, p in enumerate(prompts):
        assert list(gen.greedy[i].tokens) == greedy_reference(logp, p, MAX_NEW, stop=(EOS,))[0], f"prompt {i}"
        assert [c.sample_index for c in gen.sampled[i]] == list(range(k))
        for c in gen.sampled[i]:
            seq = list(p)
            for tok, lp in zip(c.tokens, c.logprobs):
                np.testing.assert_allclose(lp, logp(seq)[-1][tok], atol=2e-4)
                seq.append(int(tok))
    assert gen.generated_tokens == sum(len(c.tokens) for c in gen.greedy) + sum(
        len(c.tokens) for row in gen.sampled for c in row)
    assert 0 < gen.occupancy <= 1
    with pytest.raises(ValueError, match="streams=0"):
        generate_for_eval(engine, nnx.state(model), prompts, k=0, temperature=1.0, max_new_tokens=MAX_NEW, streams=0)


class _Tokenizer:
    eos_token_ids = (EOS,)

    @staticmethod
    def decode(tokens):
        return " ".join(str(t) for t in tokens)


class _ParityPool:
    """Stands in for a RewardPool: a completion is correct when its first token is even."""

    def __init__(self):
        self.rewards = {}

    def score_batch(self, items):
        from areal_jax.rewards.pool import RewardResult

        out = []
        for key, text, _ in items:
            first = int(text.split()[0]) if text else 1
            self.rewards[key] = first % 2 == 0
            out.append(RewardResult(key=key, reward=float(first % 2 == 0), status="ok", error=None, seconds=0.0))
        return out


def test_replica_engines_each_decode_their_share_with_the_reference_completions(model, prompts):
    """One engine per replica of a ("replica", "tensor") mesh (eval_engines): each holds the whole model on its own
    device and num_slots for its share; both decode, and every completion is the one-by-one reference's."""
    import jax
    from jax.sharding import Mesh

    from areal_jax.evaluation.batch import eval_engines
    from areal_jax.runtime.mesh import ROLLOUT_AXES
    from areal_jax.system.params import ParamChannel

    k = 2
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ROLLOUT_AXES)
    engines = eval_engines(model, num_slots=8, max_len=MAX_LEN, num_sequences=len(prompts) * (1 + k), mesh=mesh)
    assert [e.mesh.devices.flat[0] for e in engines] == jax.devices()[:2] and engines[0].num_slots == 8
    params = ParamChannel.for_model(model, mesh).reshard(nnx.state(model))  # a whole copy on each replica
    gen = generate_for_eval(engines, params, prompts, k=k, temperature=1.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=(EOS,), seed=4)
    assert all(e.compile_count > 0 for e in engines)  # both replicas decoded
    logp = full_forward_logp(model, MAX_LEN)
    for i, p in enumerate(prompts):
        assert list(gen.greedy[i].tokens) == greedy_reference(logp, p, MAX_NEW, stop=(EOS,))[0], f"prompt {i}"
        for c in gen.sampled[i]:
            seq = list(p)
            for tok, lp in zip(c.tokens, c.logprobs):
                np.testing.assert_allclose(lp, logp(seq)[-1][tok], atol=2e-4)
                seq.append(int(tok))
    assert len(eval_engines(model, num_slots=8, max_len=MAX_LEN, mesh=None)) == 1


def test_pass_at_k_and_pass_at_1_follow_from_the_scored_completions(model, prompts):
    k = 4
    examples = [PromptExample(uid=str(i), prompt_tokens=list(p), answer="", question="") for i, p in enumerate(prompts)]
    pool = _ParityPool()
    res = evaluate_examples(model, _Tokenizer(), examples, max_new_tokens=MAX_NEW, k=k, temperature=1.0,
                            num_slots=16, max_len=MAX_LEN, seed=5, pool=pool)
    assert len(pool.rewards) == len(prompts) * (1 + k)
    # Independent aggregation of what the pool scored: greedy mean, sampled mean, any-correct per problem.
    greedy_ok = [pool.rewards[("greedy", i, 0)] for i in range(len(prompts))]
    assert res["greedy_pass@1"] == pytest.approx(np.mean(greedy_ok))
    correct = [[pool.rewards[("sampled", i, j)] for j in range(k)] for i in range(len(prompts))]
    assert res["sampled_pass@1"] == pytest.approx(np.mean(correct))
    # pass@k with n = k samples: the share of problems with at least one correct sample (enumeration).
    assert res[f"pass@{k}"] == pytest.approx(np.mean([any(row) for row in correct]))
    assert 0 < np.mean(greedy_ok + sum(correct, [])) < 1  # the check is not vacuous
    assert res["generated_tokens"] > 0
    assert res["tokens_per_s"] > 0 and res["seconds"] >= res["generate_s"] > 0


def test_pass_at_k_equals_subset_enumeration():
    for n, c, k in [(8, 0, 1), (8, 3, 1), (8, 3, 4), (10, 2, 8), (5, 5, 2)]:
        subsets = list(itertools.combinations(range(n), k))
        hits = sum(any(i < c for i in s) for s in subsets)
        assert pass_at_k(n, c, k) == pytest.approx(hits / len(subsets))


@pytest.mark.parametrize("fit_buckets,decode_steps,standby", [(False, 1, False), (True, 3, False), (True, 3, True)])
def test_a_cache_just_long_enough_gives_the_reference_greedy_tokens(model, prompts, fit_buckets, decode_steps,
                                                                    standby):
    """The job sizes its evaluation engine to the longest test prompt + eval.max_new_tokens (rounded up to 8),
    not to rollout.max_len, and prefills every prompt in one bucket of the longest prompt rounded up to 8: the
    completions must not change when the cache ends right after them, with one or several decode steps per
    dispatch."""
    longest = max(len(p) for p in prompts)
    tight = -(-(longest + MAX_NEW) // 8) * 8
    assert tight < MAX_LEN
    engine = eval_engine(model, num_slots=4, max_len=tight, num_sequences=len(prompts),
                         longest_prompt=longest if fit_buckets else None,
                         decode_steps=decode_steps if standby else 1)
    assert engine.standby_rows == (2 if standby else 0)
    if fit_buckets:
        assert engine.prefill_buckets == (24, tight)  # prompts of 3..20 tokens: one bucket of 24
    gen = generate_for_eval(engine, nnx.state(model), prompts, k=0, temperature=1.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=(EOS,), seed=0, decode_steps=decode_steps)
    logp = full_forward_logp(model, MAX_LEN)
    for i, p in enumerate(prompts):
        assert list(gen.greedy[i].tokens) == greedy_reference(logp, p, MAX_NEW, stop=(EOS,))[0], f"prompt {i}"


def test_evaluation_decode_steps_default_follows_the_backend():
    from areal_jax.evaluation.scoring import EvalConfig

    assert EvalConfig().decode_steps_for(4, "cpu") == 1
    assert EvalConfig().decode_steps_for(16, "gpu") == 16
    assert EvalConfig(decode_steps=2).decode_steps_for(16, "cpu") == 2
    assert EvalConfig().streams_for("cpu") == 2 and EvalConfig().streams_for("gpu") == 1
    assert EvalConfig(streams=3).streams_for("gpu") == 3


def test_eval_pass_benchmark_prefills_each_problem_once():
    """benchmarks/eval_pass.py at toy size: its JSON line has the cold / warm times and a per-program
    breakdown in which 8 problems (greedy + sampled requests sharing a prompt) take one 8-row prefill."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "eval_pass.py"), "--n", "8", "--k", "2",
                          "--slots", "8", "--streams", "1"], capture_output=True, text=True, timeout=600,
                         check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["benchmark"] == "eval_pass" and report["n"] == 8 and report["cold_s"] > 0 and report["warm_s"] > 0
    assert report["breakdown_calls"]["prefill_many_fn"] == 1
    assert report["breakdown_calls"]["generate_steps_fn"] >= 1
