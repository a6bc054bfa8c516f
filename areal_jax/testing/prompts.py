"""An in-memory prompt stream for tests and benchmarks (a system.interfaces.PromptStream)."""
from __future__ import annotations

from typing import Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")


class ListPrompts(Generic[T]):
    """Serves ``examples`` in order, once; its state is the index of the next one.

    Any objects with the fields the controller reads (``prompt_tokens``, ``answer``, ``uid``) will do, so
    tests can hand the controller small stand-ins for data.PromptExample.
    """

    def __init__(self, examples: Iterable[T]):
        self._examples = list(examples)
        self._next = 0

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._next >= len(self._examples):
            raise StopIteration
        self._next += 1
        return self._examples[self._next - 1]

    def __len__(self) -> int:
        return len(self._examples)

    def get_state(self) -> dict:
        """{"next_index": i}: the position after the last example returned."""
        return {"next_index": self._next}

    def set_state(self, state: dict) -> None:
        """Resume at ``state["next_index"]`` (from get_state); ValueError for anything else."""
        index = state.get("next_index") if isinstance(state, dict) else None
        if not isinstance(index, int) or not 0 <= index <= len(self._examples):
            raise ValueError(f"Not a ListPrompts state for {len(self._examples)} examples: {state!r:.200}")
        self._next = index
