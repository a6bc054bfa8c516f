"""Greedy pass@1 and sampled pass@k of a policy on a JSONL / Parquet split.

    python -m areal_jax.programs.evaluate --model=assets/math_reasoner --data=assets/data/test.jsonl --n=500 --k=8

`--model` is an HF directory (config.json + safetensors + tokenizer files); a run's checkpoint can be
exported to one with `python -m areal_jax.programs.export`. Rewards are scored in worker processes with a
timeout, like training rewards, so a pathological completion cannot hang the evaluation.
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    import jax
    from absl import flags

    from areal_jax.data import load_eval_split
    from areal_jax.evaluation.scoring import EvalConfig, evaluate_examples
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.tokenizer import Tokenizer

    f = flags.FLAGS
    tokenizer = Tokenizer.from_pretrained(f.tokenizer or f.model)
    model = load_hf_checkpoint(f.model)
    examples = load_eval_split(f.data, tokenizer, prompt_template=f.prompt_template,
                               use_chat_template=f.chat_template, max_prompt_len=f.max_prompt_len)[: f.n]
    res = evaluate_examples(model, tokenizer, examples, max_new_tokens=f.max_new_tokens, k=f.k,
                            num_slots=f.num_slots, seed=f.seed, reward_fn=f.reward_fn,
                            streams=EvalConfig(streams=f.streams).streams_for(jax.default_backend()))
    print(f"{f.model} on {f.data} ({res['n']} problems): greedy pass@1 {res['greedy_pass@1']:.3f}"
          + (f", sampled pass@1 {res['sampled_pass@1']:.3f}, pass@{f.k} {res[f'pass@{f.k}']:.3f}" if f.k else ""))
    print(json.dumps({k: v for k, v in res.items() if k != "sample_greedy"}))


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("model", None, "HF checkpoint directory.", required=True)
    flags.DEFINE_string("tokenizer", None, "Tokenizer directory (default: --model).")
    flags.DEFINE_string("data", None, "JSONL or Parquet split (GSM8K layout).", required=True)
    flags.DEFINE_integer("n", 500, "Problems to evaluate (the first n).")
    flags.DEFINE_integer("k", 8, "Samples per problem for sampled pass@1 / pass@k (0: greedy only).")
    flags.DEFINE_integer("max_new_tokens", 64, "Completion budget.")
    flags.DEFINE_integer("max_prompt_len", 256, "Longer prompts are skipped.")
    flags.DEFINE_integer("num_slots", 256, "Sampler slots (all greedy and sampled sequences share them).")
    flags.DEFINE_integer("streams", 0, "Sampler loops side by side sharing the slots (0: 2 on CPU, 1 elsewhere).")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_string("prompt_template", "Question: {question}\nAnswer:", "Prompt template.")
    flags.DEFINE_bool("chat_template", False, "Use the tokenizer's chat template.")
    flags.DEFINE_string("reward_fn", "areal_jax.rewards.math:math_reward", "module:function reward.")
    app.run(main)
    sys.exit(0)
