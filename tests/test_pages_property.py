"""Property test: with prefix sharing, no sample's tokens ever reach a page another sample reads.

A model of the pool follows the engine's rules: a group's prompt is written once by its first sample,
the others attach to its full pages and get copies of the partial last page, and every sample writes its
generated positions through its own page table. Each pool cell records who wrote it; after every
operation every live sample must read, through its table, exactly its prompt followed by its own tokens.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_jax.sampler.pages import OutOfPages, PageAllocator

PS, PAGES, SLOTS, WIDTH = 4, 24, 6, 8

ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(1, 13), st.integers(1, 4)),  # prompt length, samples
    st.tuples(st.just("grow"), st.integers(0, SLOTS - 1), st.integers(1, 6)),  # slot, new tokens
    st.tuples(st.just("finish"), st.integers(0, SLOTS - 1), st.just(0)),
), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_no_sample_reads_another_samples_tokens(operations):
    alloc = PageAllocator(PAGES, PS, SLOTS, WIDTH)
    pool = np.full((PAGES, PS), None, object)  # (request, sample or "prompt", position) of the last write
    live: dict[int, tuple[int, int, int, int]] = {}  # slot -> (request, sample, prompt length, length)

    def write(slot, position, tag):
        page = int(alloc.table[slot, position // PS])
        assert page >= 0 and alloc.refcount[page] == 1, "a write may only land in a page its writer owns alone"
        assert position >= alloc.writable_from(slot)
        pool[page, position % PS] = tag

    for request, (op, a, b) in enumerate(operations):
        if op == "admit":
            free_slots = [s for s in range(SLOTS) if s not in live][:b]
            if not free_slots:
                continue
            source = free_slots[0]
            try:
                alloc.ensure(source, a)
            except OutOfPages:
                alloc.release(source)
                continue
            for p in range(a):
                write(source, p, (request, "prompt", p))
            try:
                copies = alloc.share_prefix(source, free_slots, a)
            except OutOfPages:
                alloc.release(source)
                continue
            for c in copies:
                pool[c.dst] = pool[c.src]
            for i, s in enumerate(free_slots):
                live[s] = (request, i, a, a)
        elif op == "grow" and a in live:
            req, sample, prompt, length = live[a]
            try:
                alloc.ensure(a, length + b)
            except (OutOfPages, ValueError):
                continue
            for p in range(length, length + b):
                write(a, p, (req, sample, p))
            live[a] = (req, sample, prompt, length + b)
        elif op == "finish" and a in live:
            alloc.release(a)
            del live[a]
        # every live sample reads its own prompt and its own tokens, nothing else
        for s, (req, sample, prompt, length) in live.items():
            for p in range(length):
                got = pool[alloc.table[s, p // PS], p % PS]
                assert got == ((req, "prompt", p) if p < prompt else (req, sample, p)), (s, p, got)
        in_use = {int(x) for x in alloc.table[alloc.table >= 0]}
        assert alloc.free_pages + len(in_use) == PAGES, "every page is either free or held"
        for page in in_use:
            assert alloc.refcount[page] == int((alloc.table == page).sum())
    for s in list(live):
        alloc.release(s)
    assert alloc.free_pages == PAGES and not alloc.refcount.any()
