"""Rollout routing replay (train.router_replay) on a mixture-of-experts model: how often the sampler's and the
trainer's routers disagree, what replaying the sampler's routes does to the trainer's log-probs of the sampled
tokens, and what recording the routes costs the sampler.

The model: Qwen3-MoE's layer (8 experts, top 2 by default), random float32 weights. The sampler decodes
`--requests` prompts (long-tailed forced lengths: median `--new-tokens`, cap `--cap`) at temperature 1 with the
weights rounded to bfloat16 (what `rollout.param_dtype=bfloat16` hands it; the compute stays float32 here; or with
`--sampler-dtype bfloat16` bf16 weights and compute), recording the experts its prefill and decode steps sent each
token to (`sampler.routes`). Two trainers score the sampled tokens in float32:

- fresh: the sampler's own weights before rounding (the mismatch is the rounding alone);
- stale: those weights plus noise of `--stale-sigma` times each tensor's standard deviation (a stand-in for the
  updates an asynchronous sampler lags behind by).

For each trainer, with its own routing (`off`) and with the sampler's routes replayed (`replay`): the mean
|log pi_train - log pi_behav| over the sampled tokens, the standard deviation of their ratio exp(.) (the decoupled
objective's behaviour weight) and the largest |gap| (a token whose experts differ); with the trainer's own
routing, the route agreement (`train/moe_route_agreement`: the share of its top-k picks the sampler made too).
Then the sampler's generated tokens/s with and without recording the routes (the same requests, warm programs,
`--repeats` runs of each alternated, the median).
Ends with one JSON line.

    python benchmarks/router_replay.py            # ~1 min on the 2-core CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.sampler import Engine, Request, SamplerLoop  # noqa: E402
from areal_jax.system.loadgen import long_tail_lengths  # noqa: E402
from areal_jax.testing.models import tiny_config  # noqa: E402
from areal_jax.trainer import Trainer, TrainerConfig  # noqa: E402
from areal_jax.trainer.batch import Trajectory  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="query heads (half as many key/value heads)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48, help="median generation length (log-normal lengths)")
    p.add_argument("--cap", type=int, default=128, help="longest generation")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--stale-sigma", type=float, default=0.02)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sampler-dtype", choices=("rounded", "bfloat16"), default="rounded",
                   help="rounded: the sampler's weights rounded to bf16, float32 compute; bfloat16: bf16 weights and "
                        "compute (rollout.param_dtype=bfloat16 with a bf16 model on an accelerator)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args):
    from areal_jax.models import Transformer

    cfg = tiny_config("qwen3_moe", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=max(1, args.heads // 2), head_dim=args.hidden // args.heads, intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden,
                      num_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=args.vocab,
                      max_position_embeddings=max(512, 64 + args.cap), eos_token_id=None)
    return Transformer(cfg, rngs=nnx.Rngs(args.seed))


def rounded(state, dtype=jnp.bfloat16):
    return jax.tree.map(lambda x: x.astype(dtype).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        state)


def perturbed(state, sigma: float, seed: int):
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [x + sigma * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
           if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2 else x for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


def generate(engine, state, requests, record: bool, seed: int):
    """(completions in request order, generated tokens/s)."""
    with SamplerLoop(engine, state, record_routes=record, seed=seed) as loop:
        loop.pause()
        for r in requests:
            loop.submit(r)
        t = time.perf_counter()
        loop.resume()
        done = [loop.get_completion(timeout=600) for _ in requests]
        seconds = time.perf_counter() - t
    if any(c is None for c in done):
        raise SystemExit("the sampler stopped before every request finished")
    done.sort(key=lambda c: c.request_id)
    return done, sum(len(c.tokens) for c in done) / seconds


def score(model, state, trajs, mode: str) -> np.ndarray:
    """The trainer's log-probs of every sampled token (concatenated), routing per `mode` (off | replay)."""
    graphdef = nnx.graphdef(model)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    trainer = Trainer(nnx.merge(graphdef, state), TrainerConfig(micro_batch_tokens=1024, router_replay=mode), mesh)
    return np.concatenate(trainer.compute_logprobs(trajs))


def agreement(model, state, trajs) -> float:
    """The share of the trainer's top-k picks (every token fed to it, every expert layer) the sampler made too."""
    n = max(len(t.tokens) - 1 for t in trajs)
    tokens = np.zeros((len(trajs), n), np.int32)
    routes = np.zeros((len(trajs), n, *trajs[0].routes.shape[1:]), np.int32)
    segments = np.zeros((len(trajs), n), np.int32)
    for i, t in enumerate(trajs):
        tokens[i, :len(t.tokens) - 1], routes[i, :len(t.tokens) - 1] = t.tokens[:-1], t.routes[:-1]
        segments[i, :len(t.tokens) - 1] = 1

    @jax.jit
    def counts(st):
        _, extras = nnx.merge(nnx.graphdef(model), st).hidden(tokens, segment_ids=segments, routes=routes,
                                                               router_stats=True)
        return extras["agree"].sum(), extras["stats"][:, 0].sum()

    agree, picks = counts(state)
    return float(agree) / float(picks)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = build_model(args)
    state = nnx.split(model)[1]
    rng = np.random.default_rng(args.seed)
    lengths = long_tail_lengths(args.requests, args.new_tokens, args.cap, seed=args.seed)
    requests = [Request(id=i, prompt=rng.integers(3, args.vocab, int(rng.integers(8, 24))).tolist(),
                        max_new_tokens=int(lengths[i]), temperature=1.0) for i in range(args.requests)]
    if args.sampler_dtype == "bfloat16":  # a bf16 copy of the model: bf16 weights, bf16 compute
        from areal_jax.models import Transformer

        bf16 = model.cfg.replace(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        sampler_model = Transformer(bf16, rngs=nnx.Rngs(0))
        sampler_state = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating)
                                     else x, state)
    else:
        sampler_model, sampler_state = model, rounded(state)
    engine = Engine(sampler_model, num_slots=args.slots, max_len=24 + args.cap + 8)
    device = jax.devices()[0].device_kind
    print(f"{model.cfg.num_params / 1e6:.2f}M params, {args.experts} experts (top {args.top_k}) in {args.layers} "
          f"layers, {args.requests} requests of {int(lengths.sum())} tokens (median {args.new_tokens}, cap {args.cap}), "
          f"{args.slots} slots, sampler: {args.sampler_dtype} ({device})")

    done, _ = generate(engine, sampler_state, requests, True, args.seed)  # compiles the decode and routes programs
    generate(engine, sampler_state, requests, False, args.seed)
    speeds = {True: [], False: []}
    for _ in range(args.repeats):
        for record in (True, False):
            speeds[record].append(generate(engine, sampler_state, requests, record, args.seed)[1])
    with_routes, without = float(np.median(speeds[True])), float(np.median(speeds[False]))
    trajs = [Trajectory(tokens=[*c.prompt, *c.tokens.tolist()], prompt_len=len(c.prompt), behav_logp=c.logprobs,
                        versions=np.zeros(len(c.tokens), np.int32), routes=c.routes) for c in done]
    behav = np.concatenate([t.behav_logp for t in trajs])
    results = {}
    for name, trainer_state in (("fresh", state), ("stale", perturbed(state, args.stale_sigma, args.seed + 1))):
        row = {"route_agreement": agreement(model, trainer_state, trajs)}
        for mode in ("off", "replay"):
            delta = score(model, trainer_state, trajs, mode) - behav
            ratio = np.exp(delta)
            row[mode] = {"mean_abs_logp_gap": float(np.abs(delta).mean()), "ratio_std": float(ratio.std()),
                         "max_abs_logp_gap": float(np.abs(delta).max())}
        results[name] = row
        print(f"  {name:5s} trainer: route agreement {row['route_agreement']:.4f}; |logp gap| own routing "
              f"{row['off']['mean_abs_logp_gap']:.5f} vs replayed {row['replay']['mean_abs_logp_gap']:.5f}; ratio std "
              f"{row['off']['ratio_std']:.5f} vs {row['replay']['ratio_std']:.5f}; largest |gap| "
              f"{row['off']['max_abs_logp_gap']:.4f} vs {row['replay']['max_abs_logp_gap']:.4f}")
    cost = with_routes / without
    print(f"  sampler: {without:.0f} generated tokens/s without recording routes, {with_routes:.0f} with "
          f"({cost:.2f}x; median of {args.repeats} alternated runs) ({device})")
    summary = {"benchmark": "router_replay", "device": device, "params": model.cfg.num_params,
               "sampler_dtype": args.sampler_dtype,
               "experts": args.experts, "top_k": args.top_k, "tokens": int(behav.size), "results": results,
               "tokens_per_s_without_routes": without, "tokens_per_s_with_routes": with_routes,
               "recording_speed_ratio": cost}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
