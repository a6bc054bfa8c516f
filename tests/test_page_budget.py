"""The paged engine's page budget on arrays (`sampler.page_budget`) against a per-row reference, and the loop's
bisection for the most samples that fit against a scan."""
from __future__ import annotations

import copy
import os
import sys

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_jax.sampler.page_budget import most_that_fit
from areal_jax.sampler.paged_engine import PagedEngine
from areal_jax.sampler.sampling import SamplingParams
from areal_jax.testing import models as testing

SLOTS, STANDBY, PS, MAX_LEN = 6, 3, 4, 64


@pytest.fixture(scope="module")
def graphdef():
    cfg = testing.tiny_config()
    return nnx.split(testing.random_model(cfg))[0], cfg


def random_state(graphdef, seed: int) -> PagedEngine:
    """Slots at random depths, some sharing a prompt's pages, some standby rows staged; limits from max_new."""
    g, cfg = graphdef
    eng = PagedEngine(g, num_slots=SLOTS, max_len=MAX_LEN, page_size=PS, num_pages=96, standby_rows=STANDBY,
                      config=cfg, attention="gather")
    rng = np.random.default_rng(seed)
    group = [int(s) for s in rng.choice(SLOTS, size=int(rng.integers(0, 4)), replace=False)]
    prompt = int(rng.integers(1, 20))
    if group:
        eng.allocator.ensure(group[0], prompt)
        eng.allocator.share_prefix(group[0], group, prompt)
    for slot in range(SLOTS):
        if slot not in group and rng.random() < 0.2:
            continue  # an idle slot
        length = prompt if slot in group else int(rng.integers(1, 20))
        eng._activate(slot, length, SamplingParams(max_new_tokens=int(rng.integers(1, 60))))
        eng._upper[slot] = int(rng.integers(length, eng._limit[slot] + 1))
        eng.allocator.ensure(slot, eng._upper[slot])
    for row in range(SLOTS, SLOTS + int(rng.integers(0, STANDBY + 1))):
        length = int(rng.integers(1, 20))
        eng._activate(row, length, SamplingParams(max_new_tokens=30))
        eng._staged[row] = length
        eng.allocator.ensure(row, min(length + 4, eng._limit[row]))
    return eng


def held(eng: PagedEngine, row: int) -> int:
    return int(np.sum(eng.allocator.table[row] >= 0))


def target(eng: PagedEngine, row: int, k: int) -> int:
    start = eng._staged.get(row)
    return min(eng._upper[row] + k if start is None else start + 2 * k, eng._limit[row])


@pytest.mark.parametrize("seed", range(8))
def test_budget_on_arrays_equals_a_pass_over_each_row(graphdef, seed):
    eng = random_state(graphdef, seed)
    pages = lambda n: -(-n // PS)  # noqa: E731
    assert eng._outstanding() == sum(max(0, pages(eng._limit[r]) - held(eng, r)) for r in eng._limit)
    for k in (1, 3, 16):
        assert eng._growth(k) == sum(max(0, pages(target(eng, r, k)) - held(eng, r)) for r in eng._limit)
    # growth: every active row ends with pages for its target, the rows' other pages untouched, the pool's count kept
    before, free = eng.allocator.table.copy(), eng.allocator.free_pages
    want_upper = {r: target(eng, r, 4) for r in eng._limit}
    growth = eng._growth(4)
    eng._grow(4)
    assert eng._upper == want_upper and eng.allocator.free_pages == free - growth
    table = eng.allocator.table
    assert np.all(table[before >= 0] == before[before >= 0])  # nothing held was replaced
    for r in eng._limit:
        assert np.all(table[r, :pages(want_upper[r])] >= 0) and held(eng, r) == max(pages(want_upper[r]),
                                                                                     int(np.sum(before[r] >= 0)))
    taken = table[(table >= 0) & (before < 0)]
    assert len(set(taken.tolist())) == len(taken) == growth  # fresh pages, each once
    assert eng._dirty == bool(growth)


@pytest.mark.parametrize("seed", range(4))
def test_admission_by_bisection_takes_what_a_scan_would(graphdef, seed):
    eng = random_state(graphdef, seed)
    for length, max_new in ((3, 8), (12, 40), (1, 63)):
        for places in (1, 2, 5, 9):
            scan = next((n for n in range(places, 0, -1) if eng.can_admit(length, max_new, n)), 0)
            probe = copy.deepcopy(eng)
            assert most_that_fit(lambda n: probe.can_admit(length, max_new, n), places) == scan


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(0, 70), k=st.integers(0, 70))
def test_most_that_fit_finds_the_edge_of_a_monotone_predicate(limit, k):
    asked = []
    got = most_that_fit(lambda n: asked.append(n) or n <= limit, k)
    assert got == min(limit, k)
    assert len(asked) <= max(1, k).bit_length() + 1 and all(1 <= n <= k for n in asked)


def test_page_budget_benchmark_reports_both_versions_agreeing():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import page_budget

    report = page_budget.main(["--slots", "16", "--standby", "8", "--staged", "4", "--pages", "600", "--max-len",
                               "256", "--places", "9", "--repeats", "2"])
    assert report["agree"] == {"outstanding": True, "growth": True, "admission": True}
    assert set(report["figures"]) == {"budget check", "growth before a dispatch", "grow 16 steps",
                                      "admission over 9 places (short pool)"}
    for row in report["figures"].values():
        assert row["before_ms"] > 0 and row["now_ms"] > 0 and row["speedup"] > 0
