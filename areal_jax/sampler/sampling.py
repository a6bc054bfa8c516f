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

Which transforms a batch needs at all (top-k, top-p, Gumbel noise) is a :class:`SamplingFilters` the caller
passes as a static value, so the compiled step holds no branch on data: on GPUs XLA runs a ``lax.cond`` by
copying its predicate to the host and waiting for the device (``BlockHostUntilDone``), a stall of the whole
stream per branch per decode step. Without it (``filters=None``) the skips are decided on the device, by
``lax.cond``, for callers that do not know their rows' settings.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = float("-inf")
SAMPLE_BLOCK = 1024  # vocabulary positions per block of `sample_tokens`' two-level draw


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


class SamplingFilters(NamedTuple):
    """Which transforms a batch of rows needs (static: one compiled program per value, at most eight).

    top_k: some row restricts to its top k tokens; top_p: some row keeps a nucleus; noise: some row samples
    (temperature > 0; with none, every row is greedy and no noise is drawn). A transform a row does not use
    leaves that row unchanged, so any superset of what the rows use gives the same tokens."""

    top_k: bool = True
    top_p: bool = True
    noise: bool = True

    @staticmethod
    def of(sampling: "SamplingParams") -> "SamplingFilters":
        """What one request needs (greedy needs nothing: it ignores top-k and top-p)."""
        sampled = sampling.temperature > 0
        return SamplingFilters(top_k=sampled and sampling.top_k_value > 0,
                               top_p=sampled and sampling.top_p_value < 1.0, noise=sampled)

    def __or__(self, other: "SamplingFilters") -> "SamplingFilters":  # type: ignore[override]
        return SamplingFilters(*(a or b for a, b in zip(self, other)))


NO_FILTERS = SamplingFilters(False, False, False)


def _sortable_keys(x: jax.Array) -> jax.Array:
    """Map float32 values to uint32 keys with the same order (-inf smallest, +inf largest)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((bits >> 31) == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row, the largest key c with ``holds(keys >= c)`` true, by bisection over uint32 keys.

    ``holds`` maps a [S, V] bool selection to [S] bool and must be monotone (true for the
    whole row, false for the empty selection). 32 rounds of one masked reduction each find the
    exact key, so no sort of the vocabulary is needed.
    """
    lo = keys.min(axis=-1)  # the whole row: holds
    hi = keys.max(axis=-1).astype(jnp.uint32) + jnp.uint32(1)  # nothing selected: fails

    def body(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(keys >= mid[:, None]) & (hi - lo > 1)
        return jnp.where(ok, mid, lo), jnp.where(ok | (hi - lo <= 1), hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def filtered_logits(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
    filters: SamplingFilters | None = None,
) -> jax.Array:
    """Apply temperature, top-k and top-p to a batch of logits.

    Top-k keeps the tokens whose logit is at least the k-th largest; top-p then keeps the
    smallest set of most likely tokens whose (top-k renormalised) probability reaches top_p.
    Both thresholds are found by bisection (no vocabulary sort); a tie at a threshold keeps every
    tied token. A restriction is left out where ``filters`` says no row uses it, or, with ``filters``
    None, skipped at run time (``lax.cond``) when no row uses it.

    Args:
      logits: [S, V] float32 raw model logits.
      temperature: [S] float32; rows with temperature <= 0 (greedy) are returned unscaled and
        unfiltered.
      top_k: [S] int32, 0 = off.
      top_p: [S] float32, 1 = off.
      filters: the transforms some row may use (static), or None to decide on the device.

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

    def restrict_k(x: jax.Array) -> jax.Array:
        keys = _sortable_keys(x)
        c = _largest_threshold(keys, lambda sel: jnp.sum(sel, axis=-1, dtype=jnp.int32) >= k)
        return jnp.where((keys >= c[:, None]) | (k[:, None] >= vocab), x, NEG_INF)

    def restrict_p(x: jax.Array) -> jax.Array:
        keys = _sortable_keys(x)
        probs = jax.nn.softmax(x, axis=-1)
        c = _largest_threshold(keys, lambda sel: jnp.sum(jnp.where(sel, probs, 0.0), axis=-1) >= p)
        return jnp.where((keys >= c[:, None]) | (p[:, None] >= 1.0), x, NEG_INF)

    if filters is not None:
        scaled = restrict_k(scaled) if filters.top_k else scaled
        return restrict_p(scaled) if filters.top_p else scaled
    identity = lambda x: x  # noqa: E731
    scaled = jax.lax.cond(jnp.any(k < vocab), restrict_k, identity, scaled)
    return jax.lax.cond(jnp.any(p < 1.0), restrict_p, identity, scaled)


def _first_argmax(x: jax.Array) -> jax.Array:
    """[..., V] -> [...] int32 index of the first maximum (two plain reductions, cheap on CPU)."""
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == x.max(axis=-1, keepdims=True), ids, x.shape[-1]), axis=-1)


def sample_tokens(
    logits: jax.Array,
    rng: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    filters: SamplingFilters | None = None,
    block: int = SAMPLE_BLOCK,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row and return it with its behaviour log-probability.

    Sampling is exact and in two levels over blocks of ``block`` vocabulary positions: one pass over the filtered
    logits gives each block's maximum and its mass (the sum of exp over the block); a block is drawn by Gumbel-max
    over the log masses, then a token inside it by Gumbel-max over its logits. P(block) x P(token | block) is the
    softmax, so the draw is exact, with S x (V / block + block) Gumbel numbers instead of S x V: at a 151,936-token
    vocabulary the noise for the whole vocabulary was most of the sampling's time, and its extra passes over the
    logits most of the rest. Greedy rows take the first block holding the row's maximum, then its first maximum
    (the first argmax). The masses give the log-sum-exp for the log-probabilities.

    Args:
      logits: [S, V] float32 raw model logits for the next token of each slot.
      rng: a PRNG key; rows draw independent samples from it.
      temperature: [S] float32 (0 = greedy); top_k: [S] int32 (0 = off); top_p: [S] float32.
      filters: static :class:`SamplingFilters` covering every row's settings, or None (then the noise is drawn
        whatever the rows: it is small).
      block: vocabulary positions per block (static); the last block is padded.

    Returns:
      tokens: [S] int32 sampled ids (argmax for greedy rows).
      logprobs: [S] float32 log-probability of each token under the distribution it was sampled
        from (after temperature / top-k / top-p); greedy rows give the raw log-softmax.
    """
    filtered = filtered_logits(logits, temperature, top_k, top_p, filters)
    greedy = temperature <= 0.0
    rows, vocab = filtered.shape
    block = max(1, min(int(block), vocab))
    blocks = -(-vocab // block)
    padded = filtered if blocks * block == vocab else jnp.pad(filtered, ((0, 0), (0, blocks * block - vocab)),
                                                              constant_values=NEG_INF)
    split = padded.reshape(rows, blocks, block)
    top = split.max(axis=-1)  # [S, blocks]
    live = top > NEG_INF  # a block with an allowed token
    base = jnp.where(live, top, 0.0)
    mass = jnp.where(live, jnp.sum(jnp.exp(split - base[..., None]), axis=-1), 0.0)  # relative to the block's max
    best = top.max(axis=-1)  # the row's maximum (the top token is always allowed)
    mass = mass * jnp.exp(base - best[:, None])  # relative to the row's maximum
    lse = best + jnp.log(jnp.sum(mass, axis=-1))
    first = _first_argmax(top)  # greedy: the first block holding the row's maximum
    noise = filters is None or filters.noise
    if noise:
        k_block, k_token = jax.random.split(rng)
        log_mass = jnp.where(mass > 0.0, jnp.log(mass), NEG_INF)
        drawn = _first_argmax(log_mass + jax.random.gumbel(k_block, log_mass.shape, jnp.float32))
        first = jnp.where(greedy, first, drawn)
    index = first[:, None] * block + jnp.arange(block, dtype=jnp.int32)[None]  # [S, block]
    inside = jnp.take_along_axis(filtered, jnp.minimum(index, vocab - 1), axis=-1)
    inside = jnp.where(index < vocab, inside, NEG_INF)
    if noise:
        inside = inside + jnp.where(greedy[:, None], 0.0, jax.random.gumbel(k_token, inside.shape, jnp.float32))
    tokens = first * block + _first_argmax(inside)
    chosen = jnp.take_along_axis(filtered, tokens[:, None], axis=-1)[:, 0]
    return tokens, (chosen - lse).astype(jnp.float32)


def behaviour_log_probs(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Full log-probability table of the sampling distribution.

    Args: as :func:`filtered_logits`.

    Returns:
      [S, V] float32 log-probabilities (-inf outside the allowed set).
    """
    return jax.nn.log_softmax(filtered_logits(logits, temperature, top_k, top_p), axis=-1)
