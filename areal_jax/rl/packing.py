"""Padding-free packing on the host (numpy): balanced token-budget micro-batches.

``balanced_microbatches`` splits samples into micro-batches of at most ``max_tokens`` tokens, a
multiple of ``n_buckets`` of them (so every data-parallel device runs the same number), with token
sums as equal as possible. `trainer.batch` lays each micro-batch out as packed rows (segment ids,
restarting positions), the layout the models take for padding-free attention.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np

BALANCE_METHODS: tuple[str, ...] = ("karmarkar_karp", "ffd")


def _validate_lengths(lengths: Sequence[int] | np.ndarray, max_tokens: int) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D list of sequence lengths (got shape {arr.shape}).")
    if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0):
        raise ValueError("lengths must be non-negative integers (token counts per sequence).")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int (got {max_tokens!r}).")
    too_long = np.flatnonzero(arr > max_tokens)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"sequence {i} has {int(arr[i])} tokens, more than the micro-batch budget "
                         f"max_tokens={max_tokens}; raise max_tokens or cap the generation length "
                         f"({too_long.size} sequence(s) too long in all).")
    return arr.astype(np.int64)


def _karmarkar_karp(lengths: np.ndarray, k: int) -> list[list[int]]:
    """k-way largest differencing: repeatedly merge the two partial partitions of largest spread,
    pairing the heavier bins of one with the lighter bins of the other."""
    tie = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i in np.argsort(-lengths, kind="stable"):
        part = [(int(lengths[i]), [int(i)])] + [(0, [])] * (k - 1)  # merges build new lists: sharing is safe
        heapq.heappush(heap, (-int(lengths[i]), next(tie), part))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are kept sorted by load, heaviest first: heavy of a meets light of b.
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda bin_: -bin_[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    return [idx for _, idx in heap[0][2]]


def _first_fit_decreasing(lengths: np.ndarray, k: int) -> list[list[int]]:
    """Longest first, each sequence into the first of k bins that stays within the mean load
    (rounded up); a sequence that fits nowhere goes to the least loaded bin."""
    target = math.ceil(int(lengths.sum()) / k) if lengths.size else 0
    loads = [0] * k
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        b = next((j for j in range(k) if loads[j] + n <= target), None)
        if b is None:
            b = min(range(k), key=loads.__getitem__)
        loads[b] += n
        bins[b].append(int(i))
    return bins


def balanced_microbatches(lengths: Sequence[int] | np.ndarray, max_tokens: int, n_buckets: int, *,
                          method: str = "karmarkar_karp") -> list[list[int]]:
    """Split sample indices into balanced micro-batches of at most max_tokens tokens each.

    The count is the smallest multiple of n_buckets (at least n_buckets) for which ``method`` finds an
    assignment within the budget; empty micro-batches appear only when there are fewer samples than
    that count. Methods: "karmarkar_karp" (k-way largest differencing, the better balance) and "ffd"
    (first-fit-decreasing against the mean load).

    Args:
      lengths: [N] int, tokens per sample (prompt + completion as packed).
      max_tokens: token budget of one micro-batch.
      n_buckets: data-parallel devices; the number of micro-batches is a multiple of it.
    Returns: micro-batches as lists of sample indices (each index exactly once, ascending within a
      micro-batch), ordered by decreasing token sum, so each consecutive run of n_buckets micro-batches
      has similar sums and can be handed to the devices as one step.
    Raises: ValueError naming the first sample longer than max_tokens, or on a bad argument.
    """
    arr = _validate_lengths(lengths, max_tokens)
    if isinstance(n_buckets, bool) or not isinstance(n_buckets, (int, np.integer)) or n_buckets < 1:
        raise ValueError(f"n_buckets must be a positive int (got {n_buckets!r}).")
    if method not in BALANCE_METHODS:
        raise ValueError(f"method={method!r} is unknown; use one of {BALANCE_METHODS}.")
    assign = _karmarkar_karp if method == "karmarkar_karp" else _first_fit_decreasing

    def round_up(x: int) -> int:
        return max(1, math.ceil(x / n_buckets)) * n_buckets

    k = round_up(math.ceil(int(arr.sum()) / max_tokens))
    k_max = round_up(arr.size)  # one sample per micro-batch always fits
    while True:
        bins = assign(arr, k)
        sums = [int(arr[b].sum()) for b in bins]
        if max(sums) <= max_tokens or k >= k_max:
            break
        k += n_buckets
    assert max(sums) <= max_tokens, "a micro-batch exceeded the token budget"
    order = sorted(range(k), key=lambda j: (-sums[j], j))
    return [sorted(bins[j]) for j in order]


def microbatch_balance(lengths: Sequence[int] | np.ndarray, microbatches: list[list[int]]) -> float:
    """Balance quality: the largest micro-batch token sum over the mean (1.0 is perfect)."""
    arr = np.asarray(lengths, dtype=np.int64)
    sums = np.array([arr[b].sum() for b in microbatches], dtype=np.float64)
    return float(sums.max() / sums.mean()) if sums.size and sums.mean() > 0 else 1.0
