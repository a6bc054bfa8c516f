"""Which engine compiled what.

Compilations are attributed through JAX's monitoring events: while an engine runs one of its jitted
functions (`compiles_counted_for(engine)`), every backend compile on that thread adds one to its
`_compiles` counter, which `Engine.compile_count` reports.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import jax

_CALLER = threading.local()  # the engine whose jitted function runs on this thread


def _count_compile(event: str, duration: float, **kwargs: Any) -> None:
    engine = getattr(_CALLER, "engine", None)
    if engine is not None and event == "/jax/core/compile/backend_compile_duration":
        engine._compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@contextlib.contextmanager
def compiles_counted_for(engine: Any) -> Iterator[None]:
    """Attribute compilations on this thread inside the block to `engine`."""
    _CALLER.engine = engine
    try:
        yield
    finally:
        _CALLER.engine = None
