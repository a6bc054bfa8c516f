"""The decode step's sampling over the vocabulary: the two-level draw (`sampler.sampling.sample_tokens`) against the
one-level Gumbel-max it replaced (noise for every token of the vocabulary, then an argmax, the chosen logit and a
log-sum-exp, each a pass over the logits).

Both take the same [--rows, --vocab] float32 logits (the 0.5B model's 151,936-token vocabulary and the sampler's
256 slots by default), temperature 1 and no top-k / top-p (the RL default), jitted; timed, best of --repeats. Checks
that greedy rows agree token for token and log-probability, and that both draws' log-probabilities are the
log-softmax at their tokens. On an H100 the one-level draw's noise fusion took ~0.19 ms of a 4.2 ms decode step and
four passes over the logits ~0.22 ms more (benchmarks/trace_top.py on the sampler's trace).

    python benchmarks/sampling_head.py                    # ~1 min on 2 CPU cores
    python benchmarks/sampling_head.py --rows 64 --vocab 32000

The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.sampler.sampling import SAMPLE_BLOCK, SamplingFilters, _first_argmax, filtered_logits, sample_tokens


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--block", type=int, default=SAMPLE_BLOCK)
    p.add_argument("--repeats", type=int, default=10)
    return p.parse_args(argv)


def one_level(logits, rng, temperature, top_k, top_p, filters):
    """The draw before the two-level one: Gumbel noise on every filtered logit, the first argmax, log-sum-exp."""
    filtered = filtered_logits(logits, temperature, top_k, top_p, filters)
    greedy = temperature <= 0.0
    noise = jax.random.gumbel(rng, filtered.shape, jnp.float32)
    tokens = _first_argmax(filtered + jnp.where(greedy[:, None], 0.0, noise))
    chosen = jnp.take_along_axis(filtered, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen - jax.nn.logsumexp(filtered, axis=-1)


def best_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv=None) -> dict:
    args = parse_args(argv)
    dev = jax.devices()[0]
    logits = jax.random.normal(jax.random.key(0), (args.rows, args.vocab), jnp.float32) * 3.0
    greedy_every_other = jnp.where(jnp.arange(args.rows) % 2 == 0, 1.0, 0.0).astype(jnp.float32)
    temp, top_k, top_p = jnp.ones((args.rows,)), jnp.zeros((args.rows,), jnp.int32), jnp.ones((args.rows,))
    filters = SamplingFilters(top_k=False, top_p=False, noise=True)
    before = jax.jit(lambda x, key, t: one_level(x, key, t, top_k, top_p, filters))
    now = jax.jit(lambda x, key, t: sample_tokens(x, key, t, top_k, top_p, filters, block=args.block))
    key = jax.random.key(1)
    before_ms, now_ms = best_ms(before, (logits, key, temp), args.repeats), best_ms(now, (logits, key, temp),
                                                                                     args.repeats)
    # agreement: greedy rows (every other one) the same token and log-prob; every log-prob the log-softmax's
    (tb, lb), (tn, ln) = before(logits, key, greedy_every_other), now(logits, key, greedy_every_other)
    table = jax.nn.log_softmax(logits, axis=-1)
    greedy = np.asarray(greedy_every_other) == 0.0
    same_greedy = bool(np.all(np.asarray(tb)[greedy] == np.asarray(tn)[greedy]))
    gap = max(float(jnp.max(jnp.abs(jnp.take_along_axis(table, t[:, None], axis=-1)[:, 0] - lp)))
              for t, lp in ((tb, lb), (tn, ln)))
    print(f"{args.rows} rows x {args.vocab} vocabulary, float32 logits, temperature 1, on {dev.device_kind} "
          f"({jax.default_backend()}); blocks of {args.block}")
    print(f"  one-level Gumbel-max (noise on every logit)   {before_ms:9.3f} ms")
    print(f"  two-level draw (sample_tokens)                {now_ms:9.3f} ms   x{before_ms / now_ms:.2f}")
    print(f"greedy rows agree: {same_greedy}; largest log-prob gap to the log-softmax {gap:.1e}")
    report = {"benchmark": "sampling_head", "device": dev.device_kind, "backend": jax.default_backend(),
              "rows": args.rows, "vocab": args.vocab, "block": args.block, "one_level_ms": round(before_ms, 4),
              "two_level_ms": round(now_ms, 4), "speedup": round(before_ms / now_ms, 3),
              "greedy_agree": same_greedy, "max_logprob_gap": gap}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
