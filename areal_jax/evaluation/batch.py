"""A whole evaluation in one pass of the sampler: every greedy and sampled sequence at full occupancy.

For n problems and k samples each, the n x (1 greedy + k sampled) sequences are queued at once into
one :class:`SamplerLoop`, so the decode slots stay full until the last few sequences (no drain between
a greedy phase and a sampled phase, one set of compiled programs). The k sampled sequences of a problem
are one request: the loop prefills the prompt once and copies it into k slots (``bulk_insert``); the
greedy sequence is a separate request (a request carries one temperature), whose prefill is batched
with other single prompts. Completions are scored in a RewardPool while generation goes on.

    gen = generate_for_eval(engine, params, prompts, k=8, temperature=1.0, max_new_tokens=48,
                            stop_token_ids=(eos,))
    gen.greedy[i]        # Completion of problem i, temperature 0
    gen.sampled[i][j]    # j-th sampled Completion of problem i
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
from flax import nnx

from areal_jax.sampler import Completion, Engine, Request, SamplerLoop
from areal_jax.sampler.config import default_standby_rows, prompt_bucket
from areal_jax.sampler.replicas import split_replicas
from areal_jax.sampler.turns import continuation_id

__all__ = ["EvalGeneration", "StreamingScorer", "eval_engine", "generate_for_eval", "generated_tokens"]


@dataclasses.dataclass
class EvalGeneration:
    """What one evaluation pass generated.

    greedy: [n] Completions at temperature 0, in problem order.
    sampled: [n][k] Completions at the sampling temperature (k may be 0).
    generated_tokens: tokens decoded in all; seconds: wall time of the pass (prefills included);
    occupancy: mean share of the decode slots busy per step.
    """

    greedy: list[Completion]
    sampled: list[list[Completion]]
    generated_tokens: int
    seconds: float
    occupancy: float

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(self.seconds, 1e-9)


def eval_engine(model_or_graphdef: Any, *, num_slots: int, max_len: int, num_sequences: int | None = None,
                mesh: Any = None, config: Any = None, max_stop_tokens: int = 8,
                longest_prompt: int | None = None, streams: int = 1, decode_steps: int = 1,
                decode_attention: str = "auto") -> Engine:
    """The Engine an evaluation decodes with; ``num_slots`` is capped at ``num_sequences`` when given
    (a 10-problem test does not need 256 slots). Keep it to evaluate again without recompiling.

    streams: the ``generate_for_eval`` streams that will share it; the engine then has
    ceil(num_slots / streams) slots (each stream its own decode state), so all streams together hold
    num_slots sequences.

    longest_prompt: the evaluation's longest prompt, when known: prompts are then prefilled in one bucket
    of that length rounded up to 8 (the default job's 29-37-token prompts: one program and rows of 40,
    instead of the power-of-two buckets 32 and 64).

    decode_steps: what the evaluation will run per dispatch; with several, each stream's slots get standby rows
    as the rollout's do (``sampler.config.default_standby_rows``: sequences wait prefilled on the device and
    take a slot inside a dispatch). decode_attention: the Engine's (the rollout's)."""
    streams = max(1, int(streams))
    slots = int(num_slots) if num_sequences is None else max(1, min(int(num_slots), int(num_sequences)))
    slots = -(-slots // streams)
    buckets = None
    if longest_prompt is not None and -(-int(longest_prompt) // 8) * 8 < int(max_len):
        buckets = (max(1, -(-int(longest_prompt) // 8) * 8), int(max_len))
    standby_len = None  # standby rows as long as the longest prompt's bucket, so that every prompt can wait in one
    if buckets:
        standby_len = buckets[0]
    elif longest_prompt is not None:
        standby_len = prompt_bucket(int(max_len), longest_prompt)
    return Engine(model_or_graphdef, num_slots=slots, max_len=int(max_len), mesh=mesh, config=config,
                  max_stop_tokens=max_stop_tokens, prefill_buckets=buckets, standby_len=standby_len,
                  standby_rows=default_standby_rows(slots, decode_steps), decode_attention=decode_attention)


def eval_engines(model_or_graphdef: Any, *, mesh: Any, num_sequences: int | None = None, **kw: Any) -> list[Engine]:
    """One `eval_engine` per replica of a ("replica", "tensor") mesh (`runtime.mesh.replica_meshes`), each with
    num_slots slots for its share of the num_sequences; `generate_for_eval` takes the list and runs its streams on
    every replica. A mesh without a replica axis gives one engine."""
    from areal_jax.runtime.mesh import replica_meshes

    if mesh is None or "replica" not in mesh.axis_names:
        return [eval_engine(model_or_graphdef, mesh=mesh, num_sequences=num_sequences, **kw)]
    rows = replica_meshes(mesh)
    share = None if num_sequences is None else -(-int(num_sequences) // len(rows))
    return [eval_engine(model_or_graphdef, mesh=m, num_sequences=share, **kw) for m in rows]


def generate_for_eval(engine: Engine | Sequence[Engine], params: nnx.State, prompts: Sequence[Sequence[int]], *, k: int,
                      temperature: float, max_new_tokens: int | Sequence[int], stop_token_ids: Sequence[int] = (),
                      seed: int = 0, decode_steps: int = 1, streams: int = 1, top_p: float | None = None,
                      on_completion: Callable[[str, int, int, Completion], None] | None = None,
                      repair: Callable[..., Any] | None = None,
                      answers: Sequence[str] | None = None) -> EvalGeneration:
    """Greedy and k sampled completions of every prompt through one sampler loop per stream.

    Args:
      engine: the Engine to decode with (see :func:`eval_engine`), or one per rollout replica (:func:`eval_engines`:
        each runs ``streams`` streams, with its own view of ``params``, `sampler.replicas.split_replicas`); params:
        the model state.
      prompts: n token-id lists; max_new_tokens: the completion budget, or one per prompt (repair turns then
        continue with the largest).
      k: sampled completions per prompt (0: greedy only); temperature: theirs (> 0); top_p: their nucleus
        (None: the whole distribution).
      streams: sampler loops run side by side on the engine, each with its own decode state of
        ``engine.num_slots`` slots and every streams-th problem (seed + stream index). On a CPU a
        decode step leaves one of two XLA threads idle most of the time (one thread per matrix
        product), and a second stream's step fills it: a 500 x 9 evaluation of the default job took
        15.3 s in two streams of 128 slots against 18.7 s in one of 256 (2-core CPU).
      on_completion: called as ``on_completion(kind, i, j, completion)`` (kind "greedy" or "sampled",
        problem i, sample j) as each finishes, one call at a time, e.g. to start scoring it.
      repair: repair turns (code tasks): a ``sampler.turns.FeedbackTurns`` maker (``FeedbackTurns.factory``) called
        with ``max_new_tokens``, ``max_len`` and ``request``, one per stream and temperature. A finished sequence
        then runs on its problem's shown cases (``answers[i]``, the tests) and, when one fails, goes back to the
        loop with the feedback for another attempt, as in training: a completion handed back holds every attempt
        and feedback (``sampler.turns.attempt_tokens`` picks one); the greedy sequence's later attempts stay greedy.

    Raises:
      RuntimeError when a prompt does not fit the engine or a loop stops early.
    """
    if k < 0:
        raise ValueError(f"k={k} must be >= 0 (sampled completions per problem).")
    if k > 0 and not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 for the sampled completions.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for the whole distribution).")
    if streams < 1:
        raise ValueError(f"streams={streams} must be at least 1.")
    n = len(prompts)
    budgets = [int(max_new_tokens)] * n if isinstance(max_new_tokens, (int, np.integer)) else \
        [int(b) for b in max_new_tokens]
    if len(budgets) != n:
        raise ValueError(f"max_new_tokens gives {len(budgets)} budgets for {n} prompts.")
    engines = [engine] if isinstance(engine, Engine) else list(engine)
    views = split_replicas(params, [e.mesh for e in engines]) if len(engines) > 1 else [params]
    streams *= len(engines)  # stream s decodes on engines[s % len(engines)]
    greedy: list[Completion | None] = [None] * n
    sampled: list[list[Completion | None]] = [[None] * k for _ in range(n)]
    stop = tuple(int(t) for t in stop_token_ids)
    lock = threading.Lock()
    occupancy: list[float] = []
    errors: list[BaseException] = []

    if repair is not None and (answers is None or len(answers) != n):
        raise ValueError("repair turns need each problem's tests: pass answers (one per prompt).")

    def record(kind: str, i: int, j: int, c: Completion) -> None:
        with lock:
            if kind == "greedy":
                greedy[i] = c
            else:
                sampled[i][j] = c
            if on_completion is not None:
                on_completion(kind, i, j, c)

    def run_stream(s: int, problems: Sequence[int]) -> None:
        engine, params = engines[s % len(engines)], views[s % len(engines)]
        turns = {}
        if repair is not None:  # one per temperature: a continuation is sampled as its first attempt was
            most = max(budgets, default=1)
            turns = {"greedy": repair(max_new_tokens=most, max_len=engine.max_len,
                                      request=dict(temperature=0.0, stop_token_ids=stop)),
                     "sampled": repair(max_new_tokens=most, max_len=engine.max_len,
                                       request=dict(temperature=temperature, top_p=top_p, stop_token_ids=stop))}
        try:
            with SamplerLoop(engine, params, seed=seed + s, decode_steps=decode_steps) as loop:
                for i in problems:  # a problem's greedy and sampled requests side by side
                    loop.submit(Request(id=("greedy", i), prompt=list(prompts[i]), max_new_tokens=budgets[i],
                                        n=1, temperature=0.0, stop_token_ids=stop))
                    if k:
                        loop.submit(Request(id=("sampled", i), prompt=list(prompts[i]),
                                            max_new_tokens=budgets[i], n=k, temperature=temperature, top_p=top_p,
                                            stop_token_ids=stop))
                left = len(problems) * (1 + k)
                while left:
                    if errors:  # another stream failed: stop early
                        return
                    c = loop.get_completion(timeout=0.02 if turns else None)
                    if c is None and (not turns or not loop.alive):
                        loop.check()
                        raise RuntimeError("the evaluation's sampler loop stopped before every sequence was "
                                           "generated.")
                    finals = []
                    if c is not None:
                        key = continuation_id(c.request_id) or (c.request_id, c.sample_index)
                        (kind, i), j = key
                        if c.finish_reason == "error":
                            raise RuntimeError(f"evaluation prompt {i} could not be generated: {c.error}")
                        if not turns:
                            record(kind, i, j, c)
                            left -= 1
                            continue
                        if turns[kind].add(key, c, list(prompts[i]), answers[i]):
                            finals.append(key)
                    for t in turns.values():
                        done, requests = t.poll()
                        finals += done
                        for request in requests:
                            loop.submit(request)
                    for key in finals:
                        (kind, i), j = key
                        merged, _ = turns[kind].final(key)
                        record(kind, i, j, merged)
                        left -= 1
                occupancy.append(float(loop.stats().get("mean_slot_occupancy", 0.0)))
        finally:
            for t in turns.values():
                t.close()

    def guarded(s: int, problems: Sequence[int]) -> None:
        try:
            run_stream(s, problems)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    t0 = time.perf_counter()
    groups = [range(s, n, streams) for s in range(min(streams, max(n, 1)))]
    if len(groups) == 1:
        run_stream(0, groups[0])
    else:
        threads = [threading.Thread(target=guarded, args=(s, g), name=f"eval-stream-{s}", daemon=True)
                   for s, g in enumerate(groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    seconds = time.perf_counter() - t0
    tokens = sum(generated_tokens(c) for c in greedy) + sum(generated_tokens(c) for row in sampled for c in row)
    return EvalGeneration(greedy, sampled, tokens, seconds,  # type: ignore[arg-type]
                          float(np.mean(occupancy)) if occupancy else 0.0)


def generated_tokens(c: Completion) -> int:
    """Tokens the model generated in ``c`` (a repaired sample's feedback tokens were not)."""
    return len(c.tokens) if c.loss_mask is None else int(np.count_nonzero(c.loss_mask))


class StreamingScorer:
    """Scores (key, text, answer) items in a RewardPool from a background thread, in chunks, so
    rewards are computed while the sampler still generates.

    pool: a RewardPool (its ``score_batch`` is used, which does not touch the pool's submit/results
    queue, so a job's pool can be shared); ``add`` queues an item; ``finish()`` waits and returns
    {key: reward}.
    """

    def __init__(self, pool: Any, chunk: int = 64) -> None:
        self.pool, self.chunk = pool, int(chunk)
        self._batch: list[tuple] = []
        self._work: queue.Queue = queue.Queue()
        self._rewards: dict = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="eval-scorer", daemon=True)
        self._thread.start()

    def add(self, key: Any, text: str, answer: str) -> None:
        self._batch.append((key, text, answer))
        if len(self._batch) >= self.chunk:
            self._work.put(self._batch)
            self._batch = []

    def _run(self) -> None:
        while True:
            items = self._work.get()
            if items is None:
                return
            try:
                for item, result in zip(items, self.pool.score_batch(items)):
                    self._rewards[item[0]] = float(result.reward)
            except BaseException as e:  # re-raised by finish()
                self._error = e
                return

    def finish(self) -> dict:
        if self._batch:
            self._work.put(self._batch)
            self._batch = []
        self._work.put(None)
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"scoring the evaluation failed: {self._error!r}") from self._error
        return self._rewards


def rewards_matrix(rewards: dict, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """greedy [n] and sampled [n, k] float32 rewards from {("greedy", i, 0) | ("sampled", i, j): r}."""
    g = np.asarray([rewards[("greedy", i, 0)] for i in range(n)], np.float32)
    s = np.asarray([[rewards[("sampled", i, j)] for j in range(k)] for i in range(n)], np.float32).reshape(n, k)
    return g, s
