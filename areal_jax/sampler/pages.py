"""Host-side page bookkeeping for the paged KV cache (``models.paged_attention``).

Every decode slot owns a row of the page table: entry j is the page holding positions
[j * page_size, (j + 1) * page_size) of the slot's sequence, or -1. Pages come from one free list:
a sequence takes pages as it grows (``ensure``) and returns them when it finishes (``release``), so the
number of live sequences is limited by the pages in use, not by slots x max_len.

Prefix sharing: the n samples of a GRPO group attach to the same prompt pages (``share_prefix``). Only
the prompt's *full* pages are shared, read-only, with a reference count; the page holding the prompt's
last, partial page is copied for every sample (copy on write at the first generated position: each
sample's first token is written into its own page), so no sample ever writes into a page another can
read. A shared page returns to the free list when its last reader finishes.
"""
from __future__ import annotations

import dataclasses

import numpy as np


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request needs; wait for sequences to finish, or add pages."""


@dataclasses.dataclass(frozen=True)
class PageCopy:
    """Copy page ``src`` into page ``dst`` (the device does it: ``copy_pages``)."""

    src: int
    dst: int


class PageAllocator:
    """Free list, page table and reference counts of a paged cache.

    Args:
      num_pages: pages in the pool.
      page_size: positions per page.
      num_slots: rows of the page table.
      pages_per_slot: longest sequence, in pages (the page table's width).
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, pages_per_slot: int) -> None:
        if min(num_pages, page_size, num_slots, pages_per_slot) < 1:
            raise ValueError("PageAllocator needs positive num_pages, page_size, num_slots and pages_per_slot, got "
                             f"{num_pages}, {page_size}, {num_slots} and {pages_per_slot}.")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.table = np.full((num_slots, pages_per_slot), -1, np.int32)
        self.refcount = np.zeros((num_pages,), np.int32)
        self._free = list(range(num_pages))[::-1]  # pop() hands out low page ids first
        self._shared_upto = np.zeros((num_slots,), np.int32)  # leading table entries that are shared, read-only

    # ------------------------------------------------------------------ queries
    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, length: int | np.ndarray) -> int | np.ndarray:
        """Pages needed to hold ``length`` positions (an int, or an integer array of lengths: element-wise)."""
        if isinstance(length, np.ndarray):
            return -(-length // self.page_size)
        return -(-int(length) // self.page_size)

    def pages_of(self, slot: int) -> list[int]:
        """The pages slot ``slot`` holds, in position order."""
        row = self.table[slot]
        return row[row >= 0].tolist()

    def writable_from(self, slot: int) -> int:
        """First position of ``slot`` that lies outside its shared (read-only) pages."""
        return int(self._shared_upto[slot]) * self.page_size

    # ------------------------------------------------------------------ changes
    def _take(self) -> int:
        if not self._free:
            raise OutOfPages(f"all {self.num_pages} KV pages are in use; finish or abort sequences, or build the "
                             "engine with more pages.")
        page = self._free.pop()
        self.refcount[page] = 1
        return page

    def _drop(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)

    def ensure(self, slot: int, length: int) -> list[int]:
        """Give ``slot`` pages for positions [0, length); returns the pages newly taken.

        Raises OutOfPages (taking nothing) when the pool cannot cover it, ValueError past the table's width."""
        need = self.pages_for(length)
        if need > self.table.shape[1]:
            raise ValueError(f"a sequence of {length} positions needs {need} pages but a slot holds at most "
                             f"{self.table.shape[1]}; raise max_len.")
        missing = np.flatnonzero(self.table[slot, :need] < 0).tolist()
        if len(missing) > len(self._free):
            raise OutOfPages(f"slot {slot} needs {len(missing)} more KV pages, {len(self._free)} are free.")
        taken = [self._take() for _ in missing]
        self.table[slot, missing] = taken
        return taken

    def share_prefix(self, source: int, slots: list[int], prompt_length: int) -> list[PageCopy]:
        """Point ``slots`` at the prompt pages of ``source`` (which holds ``prompt_length`` positions).

        Full prompt pages become shared (reference counted, read-only for every holder, ``source``
        included); a partial last page is copied into a fresh page per slot. Returns the copies the device
        must make before the slots decode. Raises OutOfPages (changing nothing) when the copies do not fit."""
        full, partial = divmod(int(prompt_length), self.page_size)
        if self.pages_for(prompt_length) > len(self.pages_of(source)):
            raise ValueError(f"slot {source} holds fewer than the {prompt_length} prompt positions it should share.")
        targets = [s for s in slots if s != source]
        if partial and len(targets) > len(self._free):
            raise OutOfPages(f"sharing a prompt with {len(targets)} samples needs {len(targets)} free KV pages for "
                             f"their partial last prompt page, {len(self._free)} are free.")
        copies = []
        for s in targets:
            if self.pages_of(s):
                raise ValueError(f"slot {s} still holds pages; release it before sharing a prefix into it.")
            for j in range(full):
                page = int(self.table[source, j])
                self.table[s, j] = page
                self.refcount[page] += 1
            if partial:
                self.table[s, full] = self._take()
                copies.append(PageCopy(int(self.table[source, full]), int(self.table[s, full])))
            self._shared_upto[s] = full
        self._shared_upto[source] = full
        return copies

    def move(self, src: int, dst: int) -> None:
        """Hand the pages of row ``src`` to row ``dst``, which holds none (a standby row's sequence moved into a
        slot); ``src`` holds none afterwards. Reference counts do not change."""
        if self.pages_of(dst):
            raise ValueError(f"row {dst} still holds pages; release it before moving row {src}'s pages into it.")
        self.table[dst], self.table[src] = self.table[src], -1
        self._shared_upto[dst], self._shared_upto[src] = self._shared_upto[src], 0

    def release(self, slot: int) -> None:
        """Return the pages of ``slot`` (shared pages once their last holder releases them)."""
        for page in self.pages_of(slot):
            self._drop(page)
        self.table[slot] = -1
        self._shared_upto[slot] = 0
