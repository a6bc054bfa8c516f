"""PPO update throughput: areal_jax Trainer against an equivalent HF transformers + PyTorch step.

One run, same weights and the same batch of trajectories for both:
  (a) Trainer.update with prox_mode="loglinear" (no extra forward: the same work as a training step);
  (b) Trainer.update with prox_mode="recompute" (one extra forward pass for the proximal log-probs);
  (c) HF transformers (PyTorch, same checkpoint): per micro-batch of padded rows (sorted by length to
      limit padding) forward, the same clipped objective, backward; then clip the gradient norm and one
      torch.optim.AdamW step. torch.set_num_threads(core count).
The engines run round-robin (a, b, c, a, b, c, ...) after one warm-up each, so they share the machine's
load; each reports its median. Prints tokens/s (trained tokens: prompt + completion), model FLOP
utilisation against this machine's float32 matmul peak (a jitted 2048^3 matmul, best of several
measurements in the same run), the ratio a/c, and ends with ONE line of JSON. Model FLOPs of a training step: 3 * forward FLOPs, forward = 2 * (matmul params) per
token + attention over the real causal context of each sequence (4 * layers * heads * head_dim * ctx);
(b) adds one forward.

    python benchmarks/trainer.py                 # default tiny model, a few minutes on 2 CPU cores
    python benchmarks/trainer.py --hidden 512 --layers 8 --skip-hf
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models import load_hf_checkpoint, testing
from areal_jax.trainer import Trainer, TrainerConfig, Trajectory
from common import add_model_args, matmul_peak_gflops, model_config


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--num-seqs", type=int, default=64, help="trajectories per update")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--median-completion", type=int, default=64)
    p.add_argument("--max-completion", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--logits-chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed updates per engine (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="leave out (c) when torch is unavailable")
    return p.parse_args()



def make_batch(args: argparse.Namespace, vocab: int) -> list[Trajectory]:
    """Trajectories with long-tailed completion lengths (clipped log-normal, sigma 1) and GRPO-like
    advantages; behaviour log-probs near uniform so importance weights stay moderate."""
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.num_seqs):
        p = int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1))
        c = int(np.clip(np.ceil(np.exp(rng.normal(np.log(args.median_completion), 1.0))), 2, args.max_completion))
        out.append(Trajectory(
            tokens=rng.integers(3, vocab, p + c), prompt_len=p,
            behav_logp=rng.normal(-np.log(vocab), 0.1, c), versions=np.zeros(c, np.int32),
            advantage=float(rng.normal()),
        ))
    return out


def forward_flops(cfg, trajs: list[Trajectory]) -> float:
    """Forward model FLOPs of the packed inputs (L - 1 tokens per trajectory, real causal context)."""
    d, hq, hd, layers = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_layers
    per_layer = d * hd * (hq + 2 * cfg.num_kv_heads) + hq * hd * d + 3 * d * cfg.intermediate_size
    dense = 2 * (layers * per_layer + d * cfg.vocab_size)
    total = 0.0
    for t in trajs:
        n = t.packed_len
        total += n * dense + 4.0 * layers * hq * hd * (n * (n + 1) / 2)
    return total


def trainer_step(model, cfg: TrainerConfig, trajs):
    """A warmed-up (compiled) callable running one Trainer.update on one device."""
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    trainer = Trainer(model, cfg, mesh)
    trainer.update(trajs)  # compile
    return lambda: trainer.update(trajs)  # returns host floats: the step has finished


def hf_step(path: str, trajs: list[Trajectory], micro_batch_tokens: int, seed: int):
    """A warmed-up callable running one HF transformers + PyTorch AdamW training step."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    order = sorted(range(len(trajs)), key=lambda i: trajs[i].packed_len)
    micro, cur = [], []
    for i in order:  # rows sorted by length; a micro-batch holds <= micro_batch_tokens padded tokens
        width = trajs[i].packed_len
        if cur and width * (len(cur) + 1) > micro_batch_tokens:
            micro.append(cur)
            cur = []
        cur.append(i)
    micro.append(cur)
    n_valid = sum(t.completion_len for t in trajs)

    def tensors(rows):
        width = max(trajs[i].packed_len for i in rows)
        ids = np.zeros((len(rows), width), np.int64)
        tgt = np.zeros_like(ids)
        att = np.zeros_like(ids)
        mask = np.zeros((len(rows), width), np.float32)
        behav = np.zeros_like(mask)
        adv = np.zeros_like(mask)
        for r, i in enumerate(rows):
            t = trajs[i]
            n = t.packed_len
            ids[r, :n], tgt[r, :n], att[r, :n] = t.tokens[:-1], t.tokens[1:], 1
            comp = slice(t.prompt_len - 1, n)
            mask[r, comp], behav[r, comp], adv[r, comp] = 1.0, t.behav_logp, t.advantage
        return [torch.from_numpy(a) for a in (ids, tgt, att, mask, behav, adv)]

    batches = [tensors(rows) for rows in micro]

    def step():
        for ids, tgt, att, mask, behav, adv in batches:
            logits = model(input_ids=ids, attention_mask=att).logits.float()
            logp = torch.log_softmax(logits, -1).gather(-1, tgt[..., None])[..., 0]
            ratio = torch.exp(logp - behav)
            surr = torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
            loss = -(surr * mask).sum() / n_valid
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    return step


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    args = parse_args()
    cfg = model_config(args)
    trajs = make_batch(args, cfg.vocab_size)
    tokens = sum(t.packed_len for t in trajs)
    fwd = forward_flops(cfg, trajs)
    peak = matmul_peak_gflops()
    base = TrainerConfig(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens, logits_chunk=args.logits_chunk)
    with tempfile.TemporaryDirectory() as path:
        testing.write_random_hf_checkpoint(path, cfg, seed=args.seed)
        model = load_hf_checkpoint(path)
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        print(f"model: {n_params / 1e6:.2f}M params, d={args.hidden}, layers={args.layers}, vocab={args.vocab}; "
              f"{len(trajs)} trajectories, {tokens} trained tokens (completion median "
              f"{int(np.median([t.completion_len for t in trajs]))}, max {max(t.completion_len for t in trajs)}); "
              f"micro_batch_tokens={args.micro_batch_tokens}; jax {jax.__version__} on {jax.devices()[0].platform}, "
              f"{os.cpu_count()} cores")
        engines = {
            "a": trainer_step(model, base.replace(prox_mode="loglinear"), trajs),
            "b": trainer_step(model, base.replace(prox_mode="recompute"), trajs),
        }
        if not args.skip_hf:
            engines["c"] = hf_step(path, trajs, args.micro_batch_tokens, args.seed)
        # Round-robin so every engine (and the peak) sees the same machine load; medians per engine.
        times = {k: [] for k in engines}
        for _ in range(args.repeats):
            peak = max(peak, matmul_peak_gflops(repeats=2))
            for k, fn in engines.items():
                times[k].append(timed(fn))
        t_a, t_b = statistics.median(times["a"]), statistics.median(times["b"])
        t_c = statistics.median(times["c"]) if "c" in times else None

    print(f"matmul peak: {peak:.1f} GFLOP/s (float32, jitted 2048^3, best of the run)")

    def row(name: str, seconds: float | None, flops: float) -> dict:
        if seconds is None:
            print(f"  {name:<44} skipped")
            return {"tokens_per_s": None, "seconds": None, "mfu": None}
        tps, mfu = tokens / seconds, flops / seconds / (peak * 1e9)
        print(f"  {name:<44} {seconds:7.3f} s  {tps:9.1f} tok/s  MFU {100 * mfu:5.1f}%")
        return {"tokens_per_s": round(tps, 1), "seconds": round(seconds, 4), "mfu": round(mfu, 4)}

    res = {
        "jax_loglinear": row("(a) areal_jax update, prox loglinear", t_a, 3 * fwd),
        "jax_recompute": row("(b) areal_jax update, prox recompute", t_b, 4 * fwd),
        "hf_torch": row("(c) HF transformers + PyTorch AdamW step", t_c, 3 * fwd),
    }
    ratio = None if t_c is None else t_c / t_a
    if ratio is not None:
        print(f"speed-up a/c: {ratio:.2f}x")
    print(json.dumps({
        "benchmark": "trainer", "params": int(n_params), "tokens": tokens, "peak_gflops": round(peak, 1),
        "micro_batch_tokens": args.micro_batch_tokens,
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in res.items()},
        "mfu": {k: v["mfu"] for k, v in res.items()},
        "speedup_vs_hf": None if ratio is None else round(ratio, 3),
    }))


if __name__ == "__main__":
    main()
