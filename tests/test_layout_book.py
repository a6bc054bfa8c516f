"""trainer.layout.ShapeBook: a micro-step shape not compiled yet is taken when nothing compiled holds the
minibatch, or once the padding it would have saved reaches new_shape_cost micro-steps (ski rental)."""
import json

import numpy as np
import pytest

from areal_jax.rl.packing import balanced_microbatches
from areal_jax.trainer.layout import ShapeBook, step_layout


def _cost(lengths, row_len, per_device, n_devices=1, overhead=0):
    rows = balanced_microbatches(lengths, row_len, n_devices * per_device)
    return len(rows) // (n_devices * per_device) * (per_device * row_len + overhead)


def test_a_new_shape_is_compiled_once_its_savings_reach_the_cost_worked_by_hand():
    """Budget 64, one device, no overhead: a micro-step costs 64 positions, so new_shape_cost=2 is 128 positions.
    [60] needs rows of 64 (one row: shape (64, 1)). Each [10] after it packs into one row of 16 at 16 positions,
    against 64 in the compiled row of 64: 48 saved. 48 and 96 fall short of 128; the third [10] brings 144 and
    takes rows of 16. Rows of 24 (40 saved each, 120 by then) stay uncompiled."""
    book = ShapeBook(new_shape_cost=2.0)
    assert step_layout([60], 1, 64, step_overhead=0, book=book)[:2] == (64, 1)
    assert book.compiled == {(64, 1)} and book.saved == {}
    for saved in (48.0, 96.0):
        row_len, per_device, rows = step_layout([10], 1, 64, step_overhead=0, book=book)
        assert (row_len, per_device, rows) == (64, 1, [[0]])
        assert book.saved[(16, 1)] == saved and book.saved[(24, 1)] == saved * 40 / 48
    assert step_layout([10], 1, 64, step_overhead=0, book=book)[:2] == (16, 1)
    assert book.compiled == {(64, 1), (16, 1)} and (16, 1) not in book.saved and book.saved[(24, 1)] == 120.0
    # Compiled now, so taken at once; the shape of the first minibatch stays compiled and is taken where cheapest.
    assert step_layout([12], 1, 64, step_overhead=0, book=book)[:2] == (16, 1)
    assert step_layout([60], 1, 64, step_overhead=0, book=book)[:2] == (64, 1)
    assert book.compiled == {(64, 1), (16, 1)}


def test_a_minibatch_no_compiled_shape_holds_takes_its_cheapest_layout():
    """A trajectory longer than every compiled row: the cheapest layout, compiled at once, whatever the cost."""
    book = ShapeBook(new_shape_cost=1e9)
    assert step_layout([10, 12], 1, 128, step_overhead=0, book=book)[:2] == (24, 1)  # [10] + [12] share a row
    assert step_layout([40, 8], 1, 128, step_overhead=0, book=book)[:2] == step_layout([40, 8], 1, 128,
                                                                                         step_overhead=0)[:2]
    assert book.compiled == {(24, 1), (48, 1)}


def test_compiled_shapes_past_a_smaller_budget_are_not_taken():
    """A run resumed with a smaller micro_batch_tokens: the book's shapes that no longer fit are passed over."""
    book = ShapeBook(new_shape_cost=1e9)
    assert step_layout([60] * 8, 1, 256, step_overhead=0, book=book)[:2] == (64, 4)
    row_len, per_device, _ = step_layout([60] * 8, 1, 128, step_overhead=0, book=book)
    assert row_len * per_device <= 128 and (row_len, per_device) in book.compiled


@pytest.mark.parametrize("seed", range(4))
def test_the_book_packs_validly_and_at_cost_zero_as_cheaply_as_without_it(seed):
    """Random minibatches on 1-4 devices: with any cost every trajectory is packed once, within its row, the
    budget and a whole number of micro-steps, in a shape the book then holds; with cost 0 every minibatch costs
    what the cheapest layout costs; with a cost never reached, a shape is compiled only when no compiled one holds
    the minibatch's longest trajectory."""
    rng = np.random.default_rng(seed)
    n_devices, budget, overhead = int(rng.choice([1, 2, 4])), int(rng.choice([256, 1024])), int(rng.choice([0, 64]))
    minibatches = [[int(x) for x in rng.integers(4, int(rng.choice([40, 120, 250])), int(rng.integers(3, 40)))]
                   for _ in range(30)]
    books = {cost: ShapeBook(cost) for cost in (0.0, 2.0, 1e9)}
    for lengths in minibatches:
        cheapest = step_layout(lengths, n_devices, budget, step_overhead=overhead)
        for cost, book in books.items():
            before = set(book.compiled)
            row_len, per_device, rows = step_layout(lengths, n_devices, budget, step_overhead=overhead, book=book)
            assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
            assert all(sum(lengths[i] for i in row) <= row_len for row in rows)
            assert len(rows) % (n_devices * per_device) == 0 and per_device * row_len <= max(budget, row_len)
            assert (row_len, per_device) in book.compiled
            if cost == 0:
                assert _cost(lengths, row_len, per_device, n_devices, overhead) == _cost(
                    lengths, cheapest[0], cheapest[1], n_devices, overhead)
            if cost == 1e9 and (row_len, per_device) not in before:
                assert all(r < max(lengths) for r, _ in before)


def test_a_book_restored_from_its_json_state_makes_the_same_choices():
    rng = np.random.default_rng(1)
    minibatches = [[int(x) for x in rng.integers(4, int(rng.choice([30, 90])), 20)] for _ in range(24)]
    book = ShapeBook(3.0)
    for lengths in minibatches[:12]:
        step_layout(lengths, 2, 512, book=book)
    assert book.saved, "the sequence should leave savings pending"
    again = ShapeBook(3.0)
    again.load_state(json.loads(json.dumps(book.state())))
    assert (again.compiled, again.saved) == (book.compiled, book.saved)
    for lengths in minibatches[12:]:
        assert step_layout(lengths, 2, 512, book=again) == step_layout(lengths, 2, 512, book=book)
    empty = ShapeBook(3.0)
    empty.load_state(None)
    assert (empty.compiled, empty.saved) == (set(), {})
