"""Offline generation through the continuous-batching loop (evaluation and benchmarks)."""
from __future__ import annotations

from typing import Sequence

from flax import nnx

from areal_jax.sampler.engine import Engine
from areal_jax.sampler.loop import Completion, Request, SamplerLoop


def generate_batch(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: Sequence[int] = (),
    num_slots: int = 64,
    seed: int = 0,
    max_len: int | None = None,
    decode_steps: int = 1,
) -> list[Completion]:
    """Generate one completion per prompt, returned in the order of ``prompts``.

    Args:
      model: a Transformer (its current params are used, version 0).
      prompts: token-id lists (any lengths).
      max_new_tokens: generation budget per prompt.
      temperature: 0 = greedy; top_k / top_p: None = off; stop_token_ids: end a sequence after
        any of these.
      num_slots: decode slots (capped at the number of prompts); fewer slots than prompts reuse
        slots as sequences finish.
      max_len: longest prompt + completion a slot holds; default the longest prompt plus
        ``max_new_tokens``. Prompts that do not fit come back with finish_reason "error".
      decode_steps: decode steps per dispatch of the loop (the tokens do not depend on it).

    Returns:
      list[Completion] with ``tokens`` / ``logprobs`` / ``versions`` per prompt.
    """
    if not prompts:
        return []
    if max_len is None:
        max_len = max(2, max(len(p) for p in prompts) + int(max_new_tokens))
    engine = Engine(model, num_slots=max(1, min(int(num_slots), len(prompts))), max_len=int(max_len),
                    max_stop_tokens=max(8, len(tuple(stop_token_ids))))
    _, params = nnx.split(model)
    results: list[Completion | None] = [None] * len(prompts)
    with SamplerLoop(engine, params, seed=seed, decode_steps=decode_steps) as loop:
        for i, prompt in enumerate(prompts):
            loop.submit(Request(id=i, prompt=list(prompt), max_new_tokens=max_new_tokens, n=1,
                                temperature=temperature, top_k=top_k, top_p=top_p,
                                stop_token_ids=tuple(stop_token_ids)))
        for _ in prompts:
            c = loop.get_completion()
            if c is None:
                raise RuntimeError("the sampler loop stopped before every prompt was answered.")
            results[c.request_id] = c
    return results  # type: ignore[return-value]
