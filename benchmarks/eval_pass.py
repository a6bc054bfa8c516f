"""One evaluation pass of the default job, timed cold and warm, with where its time goes per engine program.

    python benchmarks/eval_pass.py                   # 500 problems x (1 greedy + 8 sampled), the warm-start model
    python benchmarks/eval_pass.py --k 0             # the start evaluation (greedy only)
    python benchmarks/eval_pass.py --decode-steps 4  # k decode steps per dispatch (the job uses 1 on CPU)

The engine is built as the job builds its evaluation engine (256 slots, the cache as long as the longest test
prompt + 48 tokens rounded up to 8, prompts prefilled in one bucket of the longest prompt). Pass 1 compiles
(cold: run it with an empty compile cache to see what a new user meets), pass 2 reuses the programs, and
pass 3 blocks after every engine call to attribute wall time to the programs (prefill, insert, decode; with
several streams (`--streams`, the job's 2 on CPU) their calls overlap, so the times add up to more than the pass)
instead of overlapping them. Generation only: scoring runs in the job's reward pool beside it. Compare two
commits by running this script in a checkout of each, on the same quiet machine. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "assets", "math_reasoner")


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=ASSETS)
    p.add_argument("--data", default=os.path.join(ASSETS, "data", "test.jsonl"))
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--k", type=int, default=8, help="sampled completions per problem (0: greedy only)")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--decode-steps", type=int, default=1)
    p.add_argument("--streams", type=int, default=0,
                   help="sampler loops side by side sharing --slots (0: the job's choice, eval.streams: 2 on CPU)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the blocking third pass")
    args = p.parse_args()

    import jax
    from common import matmul_peak_gflops
    from flax import nnx

    from areal_jax.data import load_eval_split
    from areal_jax.evaluation.batch import eval_engine, generate_for_eval
    from areal_jax.evaluation.scoring import EvalConfig
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.tokenizer import Tokenizer

    peak = matmul_peak_gflops()
    streams = args.streams or EvalConfig().streams_for(jax.default_backend())
    tok = Tokenizer.from_pretrained(args.model)
    model = load_hf_checkpoint(args.model)
    examples = load_eval_split(args.data, tok)[: args.n]
    if not examples:
        raise SystemExit(f"{args.data}: no evaluation examples.")
    prompts = [list(e.prompt_tokens) for e in examples]
    longest = max(len(q) for q in prompts)
    max_len = -(-(longest + args.max_new_tokens) // 8) * 8
    engine = eval_engine(model, num_slots=args.slots, max_len=max_len, num_sequences=len(prompts) * (1 + args.k),
                         longest_prompt=longest, max_stop_tokens=max(8, len(tok.eos_token_ids)), streams=streams,
                         decode_steps=args.decode_steps)  # standby rows as the job's evaluation engine
    params = nnx.state(model)
    print(f"device {jax.devices()[0].device_kind}, float32 matmul peak {peak:.0f} GFLOP/s; {len(prompts)} problems x "
          f"(1 greedy + {args.k} sampled), {streams} stream(s) x {engine.num_slots} slots, cache {max_len}, prefill buckets "
          f"{engine.prefill_buckets}, {args.decode_steps} decode step(s) per dispatch", flush=True)

    def one_pass():
        t = time.perf_counter()
        gen = generate_for_eval(engine, params, prompts, k=args.k, temperature=1.0,
                                max_new_tokens=args.max_new_tokens, stop_token_ids=tok.eos_token_ids,
                                decode_steps=args.decode_steps, streams=streams)
        return time.perf_counter() - t, gen

    out = {"benchmark": "eval_pass", "device": jax.devices()[0].device_kind, "matmul_peak_gflops": round(peak, 1),
           "n": len(prompts), "k": args.k, "slots": engine.num_slots * streams, "streams": streams,
           "decode_steps": args.decode_steps}
    for name in ("cold", "warm"):
        seconds, gen = one_pass()
        out[f"{name}_s"] = round(seconds, 2)
        print(f"{name}: {seconds:.1f} s, {gen.generated_tokens} generated tokens ({gen.generated_tokens / seconds:,.0f}"
              f"/s), slot occupancy {gen.occupancy:.2f}", flush=True)
    out["generated_tokens"] = gen.generated_tokens
    if not args.no_breakdown:
        spent, calls = collections.defaultdict(float), collections.Counter()
        call = engine._call

        def blocking(fn, *a, **kw):
            t = time.perf_counter()
            result = jax.block_until_ready(call(fn, *a, **kw))
            name = getattr(fn, "__name__", str(fn)).strip("_")
            spent[name] += time.perf_counter() - t
            calls[name] += 1
            return result

        engine._call = blocking
        seconds, _ = one_pass()
        engine._call = call
        print(f"blocking after every engine call: {seconds:.1f} s")
        for name, s in sorted(spent.items(), key=lambda x: -x[1]):
            print(f"  {name:24s} {s:6.2f} s in {calls[name]} calls")
        out["breakdown_s"] = {name: round(s, 2) for name, s in spent.items()}
        out["breakdown_calls"] = dict(calls)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
