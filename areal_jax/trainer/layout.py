"""Micro-step layout of packed trajectories: the row length and rows per device a minibatch is packed
into, and which trajectories share each row (`step_layout`, used by trainer.batch.pack_steps)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from areal_jax.rl.packing import balanced_microbatches


def row_length(longest: int, budget: int) -> int:
    """Length of the packed rows of a minibatch whose longest trajectory has `longest` packed tokens:
    the smallest size of the form 2^k or 3 * 2^(k-1) (16, 24, 32, 48, 64, 96, ...) that holds it,
    capped at the budget rounded up to a multiple of 8. Rows are kept short because attention inside
    a row costs row_length^2; the sizes waste at most a third of a row and stay few."""
    size = 16
    while size < longest:
        size = _next_size(size)
    return min(size, _round_up(budget, 8))


# Row lengths tried above the shortest that holds the longest trajectory: up to this many times it.
ROW_LENGTH_SPAN = 4


def _row_sizes(longest: int, budget: int) -> list[int]:
    """The row lengths `step_layout` considers: the series' sizes from row_length(longest) up to
    ROW_LENGTH_SPAN times it, within the budget (rounded up to a multiple of 8)."""
    size, cap = row_length(longest, budget), _round_up(budget, 8)
    sizes = [size]
    while True:
        size = _next_size(size)
        if size > min(cap, ROW_LENGTH_SPAN * sizes[0]):
            return sizes
        sizes.append(size)


def attention_weight(model_cfg, n_params: int) -> float:
    """`step_layout`'s attention_weight for a model: layers * heads * head_dim over its parameter count
    (attention over a causal row of r positions costs ~2 * layers * heads * head_dim * r FLOPs per
    token, against ~2 * params for the matmuls). model_cfg: a ModelConfig (or anything with
    num_layers, num_heads and head_dim)."""
    return model_cfg.num_layers * model_cfg.num_heads * model_cfg.head_dim / max(int(n_params), 1)


# The fixed cost of one micro-step on a device, in positions of work: reading the weights for the forward and the
# backward, adding the gradients up and launching the programs, against ~6 FLOPs per parameter per position. That is
# about 3x the device's FLOPs per byte of memory bandwidth (~150 on an H200, ~240 on a TPU v5e); on a CPU much less.
MICRO_STEP_OVERHEAD = 256


def step_layout(lengths: Sequence[int], n_devices: int, budget: int, attention_weight: float = 0.0,
                step_overhead: int = MICRO_STEP_OVERHEAD, book: ShapeBook | None = None
                ) -> tuple[int, int, list[list[int]]]:
    """(row length, rows per device, rows as lists of indices into `lengths`) for packing trajectories
    of these packed lengths into micro-steps of at most `budget` tokens per device.

    Each candidate layout, a row length (`_row_sizes`) with a number of rows per device (`row_counts`),
    is packed with `rl.packing.balanced_microbatches` and costs, per device, its padded positions
    (micro-steps x rows x row length) times (1 + attention_weight * row length), plus `step_overhead`
    positions per micro-step; the cheapest wins, the shorter rows and then the more of them (the fewer
    micro-steps) on a tie. attention_weight is attention's cost per position of row length relative to
    the rest of a token's work (`attention_weight(model_cfg, n_params)`, which the Trainer passes).
    With a `book` (the shapes the caller has compiled programs for), a shape not compiled yet is taken
    only as `ShapeBook` decides, and the book records the choice.

    Every micro-step of a minibatch has the same shape, so the row length and the rows per device decide
    how full the last one is: rows of 96 under a budget of 2,048 hold 21 x 96 = 2,016 tokens, so 1,950
    tokens that rows of 128 pack into one micro-step of 16 x 128 took two of 21 x 96 (48% of the positions
    real, against 95%). And 68,478 tokens (the longest 1,209) on 4 devices under a budget of 16,384 filled
    one micro-step of 4 x 2 rows of 6,144 and left 19k for a second of the same size (70% of the positions
    real); three micro-steps of 4 x 4 rows of 1,536 hold them at 93%.
    """
    total, longest = int(sum(lengths)), max(lengths)
    shapes = {(row_len, per_device) for row_len in _row_sizes(longest, budget)
              for per_device in row_counts(total, row_len, n_devices, budget)}
    if book is not None:  # the compiled shapes that hold the longest trajectory within the budget are candidates too
        shapes |= {(r, k) for r, k in book.compiled
                   if longest <= r <= _round_up(budget, 8) and k <= max(1, budget // r)}
    options = []
    for row_len, per_device in shapes:
        step_cost = per_device * row_len * (1.0 + attention_weight * row_len) + step_overhead
        # No packing takes fewer micro-steps than whole ones holding every token.
        floor = _ceil_div(total, n_devices * per_device * row_len) * step_cost
        options.append((floor, row_len, per_device, step_cost))
    options.sort()
    packed = {}

    def evaluate(option) -> _Packed:
        _, row_len, per_device, step_cost = option
        if (row_len, per_device) not in packed:
            rows = balanced_microbatches(lengths, row_len, n_devices * per_device)
            packed[row_len, per_device] = _Packed(len(rows) // (n_devices * per_device) * step_cost, row_len,
                                                  per_device, rows)
        return packed[row_len, per_device]

    best = _cheapest(options, evaluate)
    if book is not None:
        best = book.settle(best, options, evaluate, book.new_shape_cost * (budget + step_overhead))
    return best.row_len, best.per_device, best.rows


@dataclasses.dataclass(frozen=True)
class _Packed:
    """One candidate layout packed: its cost, shape and rows."""

    cost: float
    row_len: int
    per_device: int
    rows: list[list[int]]

    @property
    def shape(self) -> tuple[int, int]:
        return self.row_len, self.per_device

    @property
    def rank(self) -> tuple[float, int, int]:
        """The order of preference: cheaper, then shorter rows, then more rows per device."""
        return self.cost, self.row_len, -self.per_device


def _cheapest(options, evaluate) -> _Packed:
    """The cheapest of `options` (sorted by their floor cost), packing only those whose floor can still win."""
    best = None
    for option in options:
        if best is not None and option[0] > best.cost:
            break
        candidate = evaluate(option)
        if best is None or candidate.rank < best.rank:
            best = candidate
    return best


@dataclasses.dataclass
class ShapeBook:
    """The micro-step shapes (row length, rows per device) a trainer has compiled programs for, and for each
    shape it has not, the positions that shape would have saved so far over the best compiled one.

    Every new shape costs a compile of the update's programs: seconds for a small model on a CPU, tens of
    seconds at a real model size on an accelerator. `step_layout` with a book takes the cheapest layout when
    its shape is compiled already or when no compiled shape holds the minibatch (the longest trajectory
    outgrew their rows); otherwise the best compiled layout, while each new shape that would have been
    cheaper adds what it would have saved. A new shape is compiled once its savings reach `new_shape_cost`
    micro-steps of the budget (plus the micro-step overhead): ski rental, which pays at most about twice
    what knowing the coming minibatches would have, in compiles and padding together (for one shape against
    the compiled ones). 0 takes a cheapest layout always, a compiled one on a tie.

    The choices depend only on the lengths packed so far, so every process of a job makes the same ones; the
    book goes into checkpoints (`state` / `load_state`), so a resumed run packs as the run it continues.
    """

    new_shape_cost: float = 0.0
    compiled: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    saved: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)

    def settle(self, best: _Packed, options, evaluate, threshold: float) -> _Packed:
        """The layout to use, given the cheapest one; records it as compiled."""
        known = [o for o in options if (o[1], o[2]) in self.compiled]
        pick = best
        if best.shape not in self.compiled and known:
            pick = _cheapest(known, evaluate)
            ready = []
            for option in options:
                if (option[1], option[2]) in self.compiled or option[0] >= pick.cost:
                    continue
                candidate = evaluate(option)
                if candidate.cost < pick.cost:
                    saved = self.saved[candidate.shape] = self.saved.get(candidate.shape, 0.0) + pick.cost - candidate.cost
                    if saved >= threshold:
                        ready.append(candidate)
            if ready:
                pick = min(ready, key=lambda c: c.rank)
        self.compiled.add(pick.shape)
        self.saved.pop(pick.shape, None)
        return pick

    def state(self) -> dict:
        """A JSON-able copy of what the book holds."""
        return {"compiled": sorted([list(s) for s in self.compiled]),
                "saved": sorted([[*s, v] for s, v in self.saved.items()])}

    def load_state(self, state: dict | None) -> None:
        """Restore what `state` returned (None: an empty book)."""
        state = state or {}
        self.compiled = {(int(r), int(c)) for r, c in state.get("compiled", [])}
        self.saved = {(int(r), int(c)): float(v) for r, c, v in state.get("saved", [])}


def row_counts(total_tokens: int, row_len: int, n_devices: int, budget: int) -> list[int]:
    """The rows per device `step_layout` considers for rows of `row_len`: the powers of two below what one
    micro-step of the whole minibatch needs, then the first that holds it; none above the budget (budget
    // row_len, itself a candidate when the minibatch needs more). Fewer rows in each micro-step can fill
    the last one better at the price of more micro-steps; powers of two keep the distinct shapes, and so
    the compiled programs, few."""
    most = max(1, budget // row_len)
    needed = _ceil_div(_ceil_div(max(total_tokens, 1), row_len), n_devices)
    counts, r = [], 1
    while r < min(needed, most):
        counts.append(r)
        r *= 2
    return counts + [min(r, most)]


def _next_size(size: int) -> int:
    """The next row length of the series 2^k, 3 * 2^(k-1): 16 -> 24 -> 32 -> 48 -> 64 -> 96."""
    return size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b
