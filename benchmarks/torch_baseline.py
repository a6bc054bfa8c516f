"""The HF transformers + PyTorch training step that benchmarks/trainer.py compares the Trainer against.

Per micro-batch of padded rows (sorted by length to limit padding): forward (under
torch.autocast(bfloat16) when dtype is "bfloat16"; float32 params either way), the clipped PPO objective
(eps 0.2, behaviour log-probs as the old policy) with a float32 log-softmax, backward; then clip the
gradient norm to 1 and one torch.optim.AdamW step. It runs on the device JAX runs on, or not at all.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from areal_jax.trainer import Trajectory


def torch_device() -> str | None:
    """The torch device on which JAX's default device sits: "cpu", "cuda", or None (not reachable)."""
    import torch

    forced = os.environ.get("BENCH_TORCH_DEVICE")  # e.g. "cuda" with JAX_PLATFORMS=cpu: PyTorch alone on the GPU
    if forced:
        return forced
    platform = jax.default_backend()
    if platform == "cpu":
        return "cpu"
    if platform == "gpu" and torch.cuda.is_available():
        return "cuda"
    return None


def hf_step(path: str, trajs: list[Trajectory], micro_batch_tokens: int, seed: int, dtype: str, device: str,
            minibatches: list[list[int]] | None = None):
    """A warmed-up callable running one HF transformers + PyTorch AdamW update on `device`: one optimizer
    step per minibatch (lists of trajectory indices; None: the whole batch as one), like
    Trainer.update with ppo_minibatches."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    def micro_batches(indices):
        order = sorted(indices, key=lambda i: trajs[i].packed_len)
        micro, cur = [], []
        for i in order:  # rows sorted by length; a micro-batch holds <= micro_batch_tokens padded tokens
            width = trajs[i].packed_len
            if cur and width * (len(cur) + 1) > micro_batch_tokens:
                micro.append(cur)
                cur = []
            cur.append(i)
        micro.append(cur)
        return micro

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
        return [torch.from_numpy(a).to(device) for a in (ids, tgt, att, mask, behav, adv)]

    plan = [([tensors(rows) for rows in micro_batches(mb)], sum(trajs[i].completion_len for i in mb))
            for mb in (minibatches or [list(range(len(trajs)))])]
    autocast = dtype == "bfloat16"

    def step():
        for batches, n_valid in plan:
            for ids, tgt, att, mask, behav, adv in batches:
                with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                    logits = model(input_ids=ids, attention_mask=att).logits
                logp = torch.log_softmax(logits.float(), -1).gather(-1, tgt[..., None])[..., 0]
                ratio = torch.exp(logp - behav)
                surr = torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
                loss = -(surr * mask).sum() / n_valid
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up
    return step
