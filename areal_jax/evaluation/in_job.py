"""A job's held-out evaluations (start, every N steps, end): one evaluation engine built for the largest of them
and reused, the job's reward pool, and each evaluation's per-problem records kept beside the run
(RUN_DIR/evaluations/<tag>.jsonl, the layout `python -m areal_jax.programs.evaluate --out` writes)."""
from __future__ import annotations

import json
from typing import Any

import jax

from areal_jax import paths


def records_path(run_dir: str, tag: str) -> Any:
    """Where the evaluation ``tag`` ("start", "step10", "end") of a run keeps its per-problem records."""
    return paths.join(run_dir, "evaluations", f"{tag}.jsonl")


class JobEvaluator:
    """Evaluates the policy on the job's test prompts as its config says (the `eval` section, the rollout's
    temperature and decode steps, the data formatting the examples were loaded with).

    config: the JobConfig; graphdef / model_config: the policy's; sets: {set name: its loaded test prompts}
    (evaluation.sets.load_eval_sets; a list is one set), all evaluated in one sampler pass; mesh: the rollout slice
    the engines decode on (one per rollout replica, `evaluation.batch.eval_engines`)."""

    def __init__(self, config: Any, graphdef: Any, model_config: Any, tokenizer: Any, sets: dict | list,
                 mesh: Any = None) -> None:
        from areal_jax.evaluation.sets import example_budgets, flatten

        self.config, self.graphdef, self.model_config = config, graphdef, model_config
        self.sets = sets if isinstance(sets, dict) else {"test": list(sets)}
        self.tokenizer, self.examples, self.mesh = tokenizer, flatten(self.sets), mesh
        self.budgets = example_budgets(self.sets, config.eval)  # per example, in flatten order
        backend = jax.default_backend()
        self.streams = config.eval.streams_for(backend)
        self.decode_steps = config.eval.decode_steps_for(config.rollout.decode_steps, backend)
        self._engine = None

    def engine(self) -> Any:
        """The evaluation's Engines (one per rollout replica), built on first use: the end evaluation reuses the
        start's programs."""
        if self._engine is None:
            from areal_jax.evaluation.batch import eval_engines

            c = self.config
            # Sized for the largest evaluation of the run, and no longer than its sequences: decode attention
            # reads the whole cache length (the default job's test prompts + 48 tokens need 85 of 128).
            prompt = max((len(e.prompt_tokens) for e in self.examples), default=1)
            longest = max((len(e.prompt_tokens) + b for e, b in zip(self.examples, self.budgets)), default=2)
            self._engine = eval_engines(
                self.graphdef, config=self.model_config, num_slots=c.eval.num_slots,
                max_len=max(2, min(c.rollout.max_len, -(-longest // 8) * 8)),
                num_sequences=len(self.examples) * (1 + c.eval.samples), mesh=self.mesh,
                max_stop_tokens=max(8, len(self.tokenizer.eos_token_ids)), longest_prompt=prompt,
                streams=self.streams, decode_steps=self.decode_steps, decode_attention=c.rollout.decode_attention)
        return self._engine

    def run(self, params: Any, pool: Any, tag: str, log: Any = None) -> dict:
        """Evaluate ``params`` (the rollout slice's copy) scored by ``pool``; writes the records of ``tag`` into the
        run directory and returns the figures (evaluation.scoring.evaluate_examples, without "problems"). log: gets
        a progress line at each further tenth of the sequences, at most one per 5 s (a long evaluation at real
        sizes takes minutes)."""
        from areal_jax.evaluation.scoring import evaluate_params
        from areal_jax.evaluation.sets import evaluate_sets

        c = self.config
        turns = c.eval.feedback_turns_for(c.rollout.feedback_turns)
        repair = None
        if turns:
            from areal_jax.sampler.turns import FeedbackTurns

            repair = FeedbackTurns.factory(c, self.tokenizer, turns)
        k = c.eval.samples_for(tag)

        def evaluate(examples: list) -> dict:
            return evaluate_params(
                self.graphdef, params, self.tokenizer, c.data.test_path, n=len(examples),
                max_new_tokens=self.budgets, data_config=c.data, seed=c.seed, k=k,
                temperature=c.rollout.temperature or 1.0, examples=examples, engine=self.engine(), pool=pool,
                decode_steps=self.decode_steps, streams=self.streams, records=True, repair=repair,
                log=None if log is None else (lambda line: log(line.replace("[eval]", f"[eval {tag}]", 1))))

        res = evaluate_sets(self.sets, evaluate, k)
        problems = res.pop("problems")
        target = records_path(c.run_dir, tag)
        paths.makedirs(target.parent)
        paths.write_text(target, "".join(json.dumps(p) + "\n" for p in problems))
        return res


def result_lines(tag: str, res: dict) -> list[str]:
    """The log lines of an evaluation's result: the pooled figures, then one line per set when there are several."""
    from areal_jax.evaluation.sets import set_lines

    repair = (f", {res['repair_greedy_pass@1']:.3f} after repair turns ({100 * res['repair_share']:.0f}% of the "
              f"sequences got feedback, {100 * res['repair_fixed']:.0f}% of those passed)"
              if "repair_greedy_pass@1" in res else "")
    pooled = f" (all {len(res['sets'])} sets)" if res.get("sets") else ""
    return ([f"[eval {tag}] greedy pass@1 = {res['greedy_pass@1']:.3f}{repair} on {res['n']} problems{pooled} "
             f"({res['seconds']:.0f} s, {res['tokens_per_s']:,.0f} generated tokens/s)"]
            + [f"[eval {tag}]   {line}" for line in set_lines(res)])
