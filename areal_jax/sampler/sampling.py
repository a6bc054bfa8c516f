"""Token sampling math: temperature, top-k, top-p and greedy, batched over decode slots.

Every function here is pure and jit-friendly. Per-slot sampling settings are arrays (not Python
values) so one compiled decode step serves any mix of requests:

- ``temperature: [S] float32``; ``0`` means greedy (argmax).
- ``top_k: [S] int32``; ``0`` means no top-k restriction.
- ``top_p: [S] float32`` in ``(0, 1]``; ``1`` means no nucleus restriction.

The order of the transforms is temperature, then top-k, then top-p computed on the top-k
renormalised distribution (the order used by HF transformers and vLLM). The log-probability returned
for a sampled token is taken under exactly the distribution it was drawn from (the *behaviour*
distribution the RL loss needs). Greedy rows return the plain model log-softmax at the argmax token,
i.e. the temperature-1 unfiltered distribution, which is what evaluation and parity checks compare.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Host-side sampling settings of one request.

    Attributes:
      temperature: >= 0; 0 selects greedy decoding.
      top_k: None (or 0) for no restriction, else keep the k most likely tokens (k >= 1).
      top_p: None (or 1.0) for no restriction, else keep the smallest set of most likely tokens
        whose probability reaches top_p, 0 < top_p <= 1.
      max_new_tokens: number of tokens to generate at most (>= 1).
      stop_token_ids: generation ends right after any of these tokens is emitted (it is kept).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 16
    stop_token_ids: Sequence[int] = ()

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or not np.isfinite(self.temperature):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}."
            )
        if self.top_k is not None and int(self.top_k) < 0:
            raise ValueError(f"top_k must be None, 0 (off) or a positive count, got {self.top_k}.")
        if self.top_p is not None and not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1] (1 or None turns it off), got {self.top_p}.")
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def top_k_value(self) -> int:
        """top_k as the array encoding (0 = off)."""
        return 0 if self.top_k is None else int(self.top_k)

    @property
    def top_p_value(self) -> float:
        """top_p as the array encoding (1.0 = off)."""
        return 1.0 if self.top_p is None else float(self.top_p)


def filtered_logits(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Apply temperature, top-k and top-p to a batch of logits.

    Args:
      logits: [S, V] float32 raw model logits.
      temperature: [S] float32; rows with temperature <= 0 (greedy) are returned unscaled and
        unfiltered.
      top_k: [S] int32, 0 = off.
      top_p: [S] float32, 1 = off.

    Returns:
      [S, V] float32: the scaled logits with every token outside the allowed set at -inf. A
      softmax over a row gives the distribution that row samples from.
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0.0
    t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    scaled = logits / t[:, None]
    vocab = logits.shape[-1]
    k = jnp.where(greedy | (top_k <= 0), vocab, jnp.minimum(top_k, vocab)).astype(jnp.int32)
    p = jnp.where(greedy, 1.0, top_p).astype(jnp.float32)

    def restrict(x: jax.Array) -> jax.Array:
        order = jnp.argsort(-x, axis=-1, stable=True)  # [S, V] descending, ties by lower id
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        ranks = jnp.arange(vocab, dtype=jnp.int32)[None, :]
        keep = ranks < k[:, None]
        after_k = jnp.where(keep, sorted_x, NEG_INF)
        probs = jax.nn.softmax(after_k, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = keep & ((mass_before < p[:, None]) | (ranks == 0))
        sorted_kept = jnp.where(keep, sorted_x, NEG_INF)
        rows = jnp.arange(x.shape[0])[:, None]
        return jnp.full_like(x, NEG_INF).at[rows, order].set(sorted_kept)

    needs_sort = jnp.any(k < vocab) | jnp.any(p < 1.0)
    return jax.lax.cond(needs_sort, restrict, lambda x: x, scaled)


def sample_tokens(
    logits: jax.Array,
    rng: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row and return it with its behaviour log-probability.

    Args:
      logits: [S, V] float32 raw model logits for the next token of each slot.
      rng: a PRNG key; rows draw independent samples from it.
      temperature: [S] float32 (0 = greedy); top_k: [S] int32 (0 = off); top_p: [S] float32.

    Returns:
      tokens: [S] int32 sampled ids (argmax for greedy rows).
      logprobs: [S] float32 log-probability of each token under the distribution it was sampled
        from (after temperature / top-k / top-p); greedy rows give the raw log-softmax.
    """
    filtered = filtered_logits(logits, temperature, top_k, top_p)
    sampled = jax.random.categorical(rng, filtered, axis=-1)
    greedy_tokens = jnp.argmax(filtered, axis=-1)
    tokens = jnp.where(temperature <= 0.0, greedy_tokens, sampled).astype(jnp.int32)
    chosen = jnp.take_along_axis(filtered, tokens[:, None], axis=-1)[:, 0]
    logprobs = chosen - jax.nn.logsumexp(filtered, axis=-1)
    return tokens, logprobs.astype(jnp.float32)


def behaviour_log_probs(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Full log-probability table of the sampling distribution.

    Args: as :func:`filtered_logits`.

    Returns:
      [S, V] float32 log-probabilities (-inf outside the allowed set).
    """
    return jax.nn.log_softmax(filtered_logits(logits, temperature, top_k, top_p), axis=-1)
