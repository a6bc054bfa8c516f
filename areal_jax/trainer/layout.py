"""Micro-step layout of packed trajectories: the row length and rows per device a minibatch is packed
into, and which trajectories share each row (`step_layout`, used by trainer.batch.pack_steps)."""
from __future__ import annotations

from typing import Sequence

from areal_jax.rl.packing import balanced_microbatches


def row_length(longest: int, budget: int) -> int:
    """Length of the packed rows of a minibatch whose longest trajectory has `longest` packed tokens:
    the smallest size of the form 2^k or 3 * 2^(k-1) (16, 24, 32, 48, 64, 96, ...) that holds it,
    capped at the budget rounded up to a multiple of 8. Rows are kept short because attention inside
    a row costs row_length^2; the sizes waste at most a third of a row and stay few."""
    size = 16
    while size < longest:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return min(size, _round_up(budget, 8))


# Row lengths tried above the shortest that holds the longest trajectory: up to this many times it.
ROW_LENGTH_SPAN = 4


def _row_sizes(longest: int, budget: int) -> list[int]:
    """The row lengths `step_layout` considers: the series' sizes from row_length(longest) up to
    ROW_LENGTH_SPAN times it, within the budget (rounded up to a multiple of 8)."""
    size, cap = row_length(longest, budget), _round_up(budget, 8)
    sizes = [size]
    while True:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
        if size > min(cap, ROW_LENGTH_SPAN * sizes[0]):
            return sizes
        sizes.append(size)


def attention_weight(model_cfg, n_params: int) -> float:
    """`step_layout`'s attention_weight for a model: layers * heads * head_dim over its parameter count
    (attention over a causal row of r positions costs ~2 * layers * heads * head_dim * r FLOPs per
    token, against ~2 * params for the matmuls). model_cfg: a ModelConfig (or anything with
    num_layers, num_heads and head_dim)."""
    return model_cfg.num_layers * model_cfg.num_heads * model_cfg.head_dim / max(int(n_params), 1)


def step_layout(lengths: Sequence[int], n_devices: int, budget: int,
                attention_weight: float = 0.0) -> tuple[int, int, list[list[int]]]:
    """(row length, rows per device, rows as lists of indices into `lengths`) for packing trajectories
    of these packed lengths into micro-steps of at most `budget` tokens per device.

    Each candidate row length (`_row_sizes`) is packed with `rl.packing.balanced_microbatches` and costs
    its padded positions (micro-steps x rows x row length) times (1 + attention_weight * row length);
    the cheapest wins, the shorter on a tie. attention_weight is attention's cost per position of row
    length relative to the rest of a token's work (`attention_weight(model_cfg, n_params)`, which the
    Trainer passes); 0 counts positions only. The rows-per-device rounding can leave a
    row length that does not divide the budget with a partly filled second micro-step: rows of 96
    under a budget of 2,048 hold 21 x 96 = 2,016 tokens, so 1,950 tokens that rows of 128 pack into
    one micro-step of 16 x 128 took two of 21 x 96 (48% of the positions real, against 95%).
    """
    total = int(sum(lengths))
    options = []
    for row_len in _row_sizes(max(lengths), budget):
        per_device = rows_per_device(total, row_len, n_devices, budget)
        per_step = n_devices * per_device
        weight = 1.0 + attention_weight * row_len
        # No packing uses fewer positions than whole micro-steps holding every token.
        floor = _ceil_div(total, per_step * row_len) * per_step * row_len * weight
        options.append((floor, row_len, per_device, weight))
    best = None
    for floor, row_len, per_device, weight in sorted(options):
        if best is not None and floor >= best[0]:
            break
        rows = balanced_microbatches(lengths, row_len, n_devices * per_device)
        cost = len(rows) * row_len * weight
        if best is None or (cost, row_len) < (best[0], best[1]):
            best = (cost, row_len, per_device, rows)
    return best[1], best[2], best[3]


def rows_per_device(total_tokens: int, row_len: int, n_devices: int, budget: int) -> int:
    """Rows each device takes per micro-step: as many as fit the token budget, but no more than the
    minibatch needs (rounded up to a power of two, so few distinct shapes occur)."""
    most = max(1, budget // row_len)
    needed = _ceil_div(_ceil_div(max(total_tokens, 1), row_len), n_devices)
    return min(most, 1 << max(needed - 1, 0).bit_length())


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b
