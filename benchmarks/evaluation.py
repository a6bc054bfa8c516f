"""The default job's evaluation: one sampler pass (areal_jax.evaluation.batch) against a greedy pass followed by a
sampled pass (generate_batch twice, the earlier way), on the same model, problems and machine.

    python benchmarks/evaluation.py [--n 500] [--k 8] [--slots 256] [--old-slots 64] [--repeats 1]

Prints the machine's float32 matmul peak, then per method: wall seconds (generation and scoring),
generated tokens/s and greedy / sampled pass@1; greedy pass@1 must agree (greedy decoding does not depend
on batching), sampled pass@1 agrees within sampling noise.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "math_reasoner")


def two_passes(model, tokenizer, examples, *, k: int, slots: int, max_new_tokens: int, max_len: int) -> dict:
    """A greedy pass then a sampled pass, each its own generate_batch and reward pool."""
    from areal_jax.evaluation.scoring import pass_at_k, score_completions
    from areal_jax.sampler import generate_batch

    t0 = time.perf_counter()
    prompts = [list(e.prompt_tokens) for e in examples]
    answers = [e.answer for e in examples]
    stop = tuple(tokenizer.eos_token_ids)
    greedy = generate_batch(model, prompts, max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop,
                            num_slots=slots, max_len=max_len)
    g = score_completions([tokenizer.decode(list(c.tokens)) for c in greedy], answers,
                          "areal_jax.rewards.math:math_reward")
    sampled = generate_batch(model, [p for p in prompts for _ in range(k)], max_new_tokens=max_new_tokens,
                             temperature=1.0, stop_token_ids=stop, num_slots=slots, seed=1, max_len=max_len)
    s = score_completions([tokenizer.decode(list(c.tokens)) for c in sampled], [a for a in answers for _ in range(k)],
                          "areal_jax.rewards.math:math_reward")
    correct = (s.reshape(len(examples), k) >= 1.0).sum(axis=1)
    tokens = sum(len(c.tokens) for c in greedy) + sum(len(c.tokens) for c in sampled)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "greedy_pass@1": float(np.mean(g >= 1.0)),
            "sampled_pass@1": float(np.mean(correct / k)),
            f"pass@{k}": float(np.mean([pass_at_k(k, int(c), k) for c in correct]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=500, help="test problems")
    p.add_argument("--k", type=int, default=8, help="sampled completions per problem")
    p.add_argument("--slots", type=int, default=256, help="decode slots of the one-pass evaluation")
    p.add_argument("--old-slots", type=int, default=64, help="decode slots of each earlier pass")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()

    from common import matmul_peak_gflops

    from areal_jax.data import load_eval_split
    from areal_jax.evaluation.scoring import evaluate_examples
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.tokenizer import Tokenizer

    print(f"float32 matmul peak: {matmul_peak_gflops():.0f} GFLOP/s", flush=True)
    tokenizer = Tokenizer.from_pretrained(ASSETS)
    model = load_hf_checkpoint(ASSETS)
    examples = load_eval_split(os.path.join(ASSETS, "data", "test.jsonl"), tokenizer, max_prompt_len=80)[: args.n]
    for r in range(args.repeats):
        old = two_passes(model, tokenizer, examples, k=args.k, slots=args.old_slots, max_new_tokens=48, max_len=128)
        new = evaluate_examples(model, tokenizer, examples, max_new_tokens=48, k=args.k, num_slots=args.slots,
                                max_len=128)
        for name, res in (("two passes", old), ("one pass", new)):
            print(f"[{r}] {name:>10}: {res['seconds']:6.1f} s, {res['tokens_per_s']:7,.0f} generated tok/s, greedy "
                  f"pass@1 {res['greedy_pass@1']:.3f}, sampled pass@1 {res['sampled_pass@1']:.3f}, "
                  f"pass@{args.k} {res[f'pass@{args.k}']:.3f}", flush=True)
        print(f"[{r}] speed-up {old['seconds'] / new['seconds']:.2f}x", flush=True)
    print(f"float32 matmul peak after: {matmul_peak_gflops():.0f} GFLOP/s")


if __name__ == "__main__":
    main()
