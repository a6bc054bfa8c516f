"""Scoring a policy on an evaluation split: greedy pass@1, sampled pass@1 and pass@k.

The job's periodic evaluations and the `python -m areal_jax.programs.evaluate` program both call
`evaluate_params` / `evaluate_examples`; generation goes through one sampler loop
(areal_jax.evaluation.batch) and rewards are scored in worker processes while it runs.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from areal_jax.knobs import Section, knob, require


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def score_completions(texts: Sequence[str], answers: Sequence[str], reward_fn: Any, timeout_s: float = 5.0,
                      num_workers: int = 2) -> np.ndarray:
    """Rewards of texts against answers, scored in a RewardPool; [len(texts)] float32."""
    from areal_jax.rewards.pool import RewardPool

    with RewardPool(reward_fn, num_workers=num_workers, timeout_s=timeout_s) as pool:
        results = pool.score_batch(list(zip(range(len(texts)), texts, answers)))
    by_key = {r.key: r.reward for r in results}
    return np.asarray([by_key[i] for i in range(len(texts))], np.float32)


def evaluate_examples(model: Any, tokenizer: Any, examples: list, *, max_new_tokens: int | Sequence[int], k: int = 8,
                      temperature: float = 1.0, num_slots: int = 256, max_len: int | None = None,
                      seed: int = 0, reward_fn: Any = "areal_jax.rewards.math:math_reward",
                      reward_timeout_s: float = 5.0, engine: Any = None, params: Any = None,
                      pool: Any = None, decode_steps: int = 1, streams: int = 1,
                      reward_cache_size: int = 16384, top_p: float | None = None, records: bool = False,
                      log: Callable[[str], None] | None = None, mesh: Any = None,
                      repair: Callable[..., Any] | None = None) -> dict:
    """Greedy pass@1, sampled pass@1 and pass@k (k samples per problem at `temperature`).

    model: an areal_jax Transformer (or None when `engine` and `params` are given); examples:
    data.PromptExample list; max_new_tokens: the completion budget, or one per example. k = 0 skips sampling. All n x (1 + k) sequences go through one sampler
    loop (areal_jax.evaluation.batch) and are scored while it runs.
    reward_fn: a "module:function" string or picklable callable (see RewardPool); pool: an open
    RewardPool to score with instead (e.g. the job's), reward_fn is then unused; reward_cache_size: its own
    pool scores identical completions of a problem once (RewardPool's cache_size; 0 for rewards with randomness).
    engine / params: an Engine (evaluation.batch.eval_engine) and the state to decode with, to evaluate
    again without recompiling; by default built from `model` with `num_slots` slots in all.
    streams: sampler loops side by side (evaluation.batch.generate_for_eval), sharing the slots.
    mesh: the mesh the default engine decodes on: ("fsdp", "tensor") for one engine (tensor parallel), or
    ("replica", "tensor") for one engine of num_slots slots per replica (evaluation.batch.eval_engines; the model's
    weights laid out on that mesh, a whole copy per replica); None: one device.
    top_p: the sampled completions' nucleus (None: off). log: called with a progress line each time another
    tenth of the n x (1 + k) sequences has been generated (long evaluations at real sizes take minutes).
    Returns greedy_pass@1, greedy_len, sampled_pass@1, pass@k, the generation's tokens / seconds /
    tokens_per_s / occupancy, the whole evaluation's seconds, and one greedy completion as text; with
    ``records``, also "problems": per problem its uid, question, greedy completion and reward, finish reason,
    sampled completions and rewards (``problem_records``).

    repair: repair turns (code tasks; a ``sampler.turns.FeedbackTurns.factory`` maker): each sequence that fails its
    problem's shown cases gets the feedback and another attempt, as in training (evaluation.batch.generate_for_eval).
    The figures above are then those of the first attempts (what a one-turn evaluation measures: the greedy ones are
    the same sequences), and repair_greedy_pass@1, repair_sampled_pass@1 and repair_pass@k those of the last
    attempts; repair_share is the share of sequences that got feedback, repair_fixed the share of those whose last
    attempt passed. A completion's record then holds every attempt and feedback, its reward the last attempt's.
    """
    from flax import nnx

    from areal_jax.evaluation.batch import (
        StreamingScorer,
        eval_engines,
        generate_for_eval,
        generated_tokens,
        rewards_matrix,
    )
    from areal_jax.rewards.pool import RewardPool
    from areal_jax.sampler.turns import attempt_tokens

    t0 = time.perf_counter()
    n = len(examples)
    prompts = [list(e.prompt_tokens) for e in examples]
    answers = [e.answer for e in examples]
    stop = tuple(tokenizer.eos_token_ids)
    budgets = [int(max_new_tokens)] * n if isinstance(max_new_tokens, (int, np.integer)) else \
        [int(b) for b in max_new_tokens]
    if len(budgets) != n:
        raise ValueError(f"max_new_tokens gives {len(budgets)} budgets for {n} examples.")
    if engine is None:
        if max_len is None:
            max_len = max(2, max((len(p) + b for p, b in zip(prompts, budgets)), default=1))
        engine = eval_engines(model, num_slots=num_slots, max_len=max_len, num_sequences=n * (1 + k),
                              max_stop_tokens=max(8, len(stop)),
                              longest_prompt=max((len(p) for p in prompts), default=1), streams=streams,
                              decode_steps=decode_steps, mesh=mesh)
    if params is None:
        params = nnx.state(model)
    own_pool = pool is None
    if own_pool:
        pool = RewardPool(reward_fn, num_workers=2, timeout_s=reward_timeout_s, cache_size=reward_cache_size)
    texts: dict[tuple, str] = {}
    finish: dict[tuple, str] = {}
    progress = _Progress(n * (1 + k), log)
    try:
        scorer = StreamingScorer(pool)

        def score(kind: str, i: int, j: int, completion: Any) -> None:
            texts[(kind, i, j)] = tokenizer.decode(list(completion.tokens))
            finish[(kind, i, j)] = completion.finish_reason
            if completion.turns is None:
                scorer.add((kind, i, j), texts[(kind, i, j)], answers[i])
            else:  # the last attempt is the answer; the first is what a one-turn evaluation would have scored
                scorer.add((kind, i, j), tokenizer.decode(list(attempt_tokens(completion, -1))), answers[i])
                scorer.add((_FIRST + kind, i, j), tokenizer.decode(list(attempt_tokens(completion, 0))), answers[i])
            progress.add(generated_tokens(completion))

        gen = generate_for_eval(engine, params, prompts, k=k, temperature=temperature,
                                max_new_tokens=budgets, stop_token_ids=stop, seed=seed,
                                decode_steps=decode_steps, streams=streams, on_completion=score, top_p=top_p,
                                repair=repair, answers=answers)
        rewards = scorer.finish()
    finally:
        if own_pool:
            pool.close()
    last_g, last_s = rewards_matrix(rewards, n, k)
    first = {key: rewards.get((_FIRST + key[0], *key[1:]), r) for key, r in rewards.items() if key[0] in _KINDS}
    g_rewards, s_rewards = rewards_matrix(first, n, k)
    out = {"n": n, **_pass_figures(g_rewards, s_rewards, k),
           "greedy_len": float(np.mean([len(attempt_tokens(c, 0)) for c in gen.greedy])) if n else 0.0}
    if repair is not None:
        out.update({f"repair_{name}": v for name, v in _pass_figures(last_g, last_s, k).items()})
        repaired = [c.turns is not None for c in gen.greedy] + [c.turns is not None for row in gen.sampled for c in row]
        fixed = np.concatenate([last_g, last_s.reshape(-1)]) >= 1.0
        out["repair_share"] = float(np.mean(repaired)) if repaired else 0.0
        out["repair_fixed"] = float(np.mean(fixed[np.asarray(repaired, bool)])) if any(repaired) else 0.0
    out.update({"generated_tokens": gen.generated_tokens, "generate_s": gen.seconds,
                "tokens_per_s": gen.tokens_per_s, "occupancy": gen.occupancy,
                "seconds": time.perf_counter() - t0})
    out["sample_greedy"] = texts.get(("greedy", 0, 0), "")
    if records:
        out["problems"] = problem_records(examples, texts, finish, last_g, last_s)
        if repair is not None:
            for i, record in enumerate(out["problems"]):
                record["greedy_first_reward"] = float(g_rewards[i])
                record["sample_first_rewards"] = [float(r) for r in s_rewards[i]]
                record["correct_first"] = int((s_rewards[i] >= 1.0).sum())
    return out


_KINDS = ("greedy", "sampled")
_FIRST = "first_"  # the scorer's key of a repaired sequence's first attempt: ("first_greedy", i, j)


def _pass_figures(greedy: np.ndarray, sampled: np.ndarray, k: int) -> dict:
    """greedy_pass@1 of [n] rewards, and with k > 0 sampled_pass@1 and pass@k of [n, k]."""
    n = len(greedy)
    out = {"greedy_pass@1": float(np.mean(greedy >= 1.0)) if n else 0.0}
    if k > 0:
        correct = (sampled >= 1.0).sum(axis=1)
        out["sampled_pass@1"] = float(np.mean(correct / k)) if n else 0.0
        out[f"pass@{k}"] = float(np.mean([pass_at_k(k, int(c), k) for c in correct])) if n else 0.0
    return out


def problem_records(examples: Sequence[Any], texts: dict, finish: dict, greedy_rewards: np.ndarray,
                    sampled_rewards: np.ndarray) -> list[dict]:
    """One JSON-ready dict per problem: uid ("<file>:<row>:0"), question, greedy completion, its reward and
    finish reason ("stop" / "length"), the k sampled completions, their rewards and how many scored 1."""
    out = []
    for i, e in enumerate(examples):
        k = sampled_rewards.shape[1]
        out.append({"uid": e.uid, "question": e.question, "greedy": texts[("greedy", i, 0)],
                    "greedy_reward": float(greedy_rewards[i]), "greedy_finish": finish[("greedy", i, 0)],
                    "samples": [texts[("sampled", i, j)] for j in range(k)],
                    "sample_rewards": [float(r) for r in sampled_rewards[i]],
                    "correct": int((sampled_rewards[i] >= 1.0).sum())})
    return out


class _Progress:
    """Counts generated sequences and reports each further tenth of ``total`` to ``log`` (if any), at most one
    line per ``min_interval_s`` before the last."""

    min_interval_s = 5.0

    def __init__(self, total: int, log: Callable[[str], None] | None) -> None:
        self.total, self.log, self.done, self.tokens, self.t0 = total, log, 0, 0, time.perf_counter()
        self._next, self._last = 1, self.t0

    def add(self, tokens: int) -> None:
        self.done += 1
        self.tokens += int(tokens)
        if self.log is None or self.total <= 0 or self.done * 10 < self._next * self.total:
            return
        while self._next <= 10 and self.done * 10 >= self._next * self.total:
            self._next += 1
        now = time.perf_counter()
        if now - self._last < self.min_interval_s and self.done < self.total:
            return  # a short evaluation: no line per tenth
        self._last, dt = now, now - self.t0
        self.log(f"[eval] {self.done:,} / {self.total:,} sequences generated ({100 * self.done / self.total:.0f}%), "
                 f"{dt:.0f} s, {self.tokens / max(dt, 1e-9):,.0f} tokens/s")


def load_eval_examples(path: str, tokenizer: Any, data_config: Any, n: int) -> list:
    """The first n prompts of an evaluation split, formatted like training (data_config: the config's
    `data` section). A file with no usable rows is a ValueError naming it."""
    from areal_jax.data import load_eval_split

    return load_eval_split(
        path, tokenizer, question_field=data_config.question_field, answer_field=data_config.answer_field,
        prompt_template=data_config.prompt_template, use_chat_template=data_config.use_chat_template,
        system_prompt=data_config.system_prompt, max_prompt_len=data_config.max_prompt_len,
        task=data_config.task,
    )[:n]


def evaluate_params(graphdef: Any, params: Any, tokenizer: Any, path: str, *, n: int,
                    max_new_tokens: int | Sequence[int],
                    data_config: Any, num_slots: int = 256, max_len: int | None = None, mesh: Any = None,
                    seed: int = 0, k: int = 8, reward_fn: Any = "areal_jax.rewards.math:math_reward",
                    reward_timeout_s: float = 5.0, examples: list | None = None, engine: Any = None,
                    pool: Any = None, decode_steps: int = 1, temperature: float = 1.0, streams: int = 1,
                    records: bool = False, log: Callable[[str], None] | None = None,
                    repair: Callable[..., Any] | None = None) -> dict:
    """Evaluate params (an nnx.State, or a FlatParams) on the first n problems of a split, formatted like training
    (or on `examples`, already loaded by load_eval_examples). engine / pool / records / log / repair: see
    evaluate_examples.

    data_config.task "code" reads programming tasks (pass the code reward as reward_fn)."""
    from flax import nnx

    from areal_jax.models import as_tree

    if examples is None:
        examples = load_eval_examples(path, tokenizer, data_config, n)
    examples = examples[:n]
    if not isinstance(max_new_tokens, (int, np.integer)):
        max_new_tokens = list(max_new_tokens)[:n]
    model = nnx.merge(graphdef, as_tree(params)) if engine is None else None
    return evaluate_examples(model, tokenizer, examples, max_new_tokens=max_new_tokens, k=k,
                             temperature=temperature, num_slots=num_slots, max_len=max_len, seed=seed,
                             reward_fn=reward_fn, reward_timeout_s=reward_timeout_s, engine=engine,
                             params=params, pool=pool, decode_steps=decode_steps, streams=streams, records=records,
                             log=log, repair=repair)


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """Held-out evaluation during a job (the config's `eval` section)."""

    section: ClassVar[str] = "eval"

    n_test: int = knob(500, "problems of data.test_path; 0 disables evaluation")
    at_start: bool = knob(True, "evaluate before the first update")
    at_end: bool = knob(True, "evaluate after the last update")
    every_steps: int = knob(0, "also evaluate every this many steps; 0 = never in between")
    max_new_tokens: int = knob(64, "completion tokens at most per evaluation sample")
    set_max_new_tokens: str = knob("", "evaluation sets with a budget of their own, NAME=N,... of data.test_path's set "
                                   "names (the others take eval.max_new_tokens), e.g. gsm8k=256,aime=4096")
    samples: int = knob(8, "sampled completions per problem (sampled pass@1, pass@k); 0 = greedy only")
    feedback_turns: int = knob(-1, "code tasks: repair turns of each evaluation sequence, each after execution "
                                   "feedback on the task's first cases as in training (rollout.feedback_cases, "
                                   "rollout.feedback_template); the figures then come twice, first attempts "
                                   "(greedy_pass@1, ...) and last (repair_greedy_pass@1, ...); -1 = "
                                   "rollout.feedback_turns, 0 = one turn")
    start_samples: int = knob(-1, "sampled completions per problem at the start evaluation; -1 = eval.samples, "
                                  "0 = greedy pass@1 only (the before-training baseline at a ninth of the cost)")
    num_slots: int = knob(256, "decode slots of the evaluation's sampler (all greedy + sampled sequences in one pass)")
    decode_steps: int = knob(0, "decode steps per dispatch of the evaluation's sampler; 0 = 1 on CPU (a 256-slot "
                                "step is long, and slots that finish mid-dispatch idle: the default job's end "
                                "evaluation took 34 s at 1 step against 39 s at 4) and rollout.decode_steps "
                                "elsewhere")
    streams: int = knob(0, "sampler loops the evaluation runs side by side, sharing eval.num_slots; 0 = 2 on CPU "
                           "(one XLA thread per matrix product leaves the other idle in a decode step: the default "
                           "job's 500 x 9 evaluation took 15.3 s in 2 streams against 18.7 s in 1) and 1 elsewhere")

    @property
    def enabled(self) -> bool:
        return self.n_test > 0 and bool(self.at_start or self.at_end or self.every_steps)

    def check(self) -> None:
        k = self.key
        require(self.n_test >= 0, f"{k('n_test')}={self.n_test} must be >= 0 (0 disables evaluation).")
        require(self.every_steps >= 0, f"{k('every_steps')}={self.every_steps} must be >= 0.")
        require(self.max_new_tokens >= 1, f"{k('max_new_tokens')}={self.max_new_tokens} must be at least 1.")
        require(self.samples >= 0, f"{k('samples')}={self.samples} must be >= 0 (0 = greedy pass@1 only).")
        require(self.num_slots >= 1, f"{k('num_slots')}={self.num_slots} must be at least 1.")
        require(self.decode_steps >= 0, f"{k('decode_steps')}={self.decode_steps} must be >= 0 (0 = automatic).")
        require(self.streams >= 0, f"{k('streams')}={self.streams} must be >= 0 (0 = automatic).")
        require(self.feedback_turns >= -1,
                f"{k('feedback_turns')}={self.feedback_turns} must be -1 (as rollout.feedback_turns), 0 (one turn) "
                "or more.")
        require(self.start_samples >= -1,
                f"{k('start_samples')}={self.start_samples} must be -1 (same as eval.samples), 0 (greedy only) or more.")

    def decode_steps_for(self, rollout_decode_steps: int, backend: str) -> int:
        """The evaluation's decode steps per dispatch: eval.decode_steps, or when 0, 1 on CPU and the rollout's
        elsewhere."""
        if self.decode_steps:
            return self.decode_steps
        return 1 if backend == "cpu" else int(rollout_decode_steps)

    def streams_for(self, backend: str) -> int:
        """The evaluation's sampler streams: eval.streams, or when 0, 2 on CPU and 1 elsewhere."""
        if self.streams:
            return self.streams
        return 2 if backend == "cpu" else 1

    def feedback_turns_for(self, rollout_feedback_turns: int) -> int:
        """Repair turns of each evaluation sequence: eval.feedback_turns, or when -1 the rollout's."""
        return int(rollout_feedback_turns) if self.feedback_turns < 0 else self.feedback_turns

    def samples_for(self, tag: str) -> int:
        """Sampled completions per problem of the evaluation named `tag` ("start", "end", "step_N")."""
        if tag == "start" and self.start_samples >= 0:
            return self.start_samples
        return self.samples
