"""Which engine compiled what, and what a compiled dispatch costs.

Compilations are attributed through JAX's monitoring events: while an engine runs one of its jitted
functions (`compiles_counted_for(engine)`), every backend compile on that thread adds one to its
`_compiles` counter, which `Engine.compile_count` reports. `decode_steps_program` compiles an engine's k-step
decode dispatch ahead of time for XLA's cost analysis and program text (benchmarks, tests).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import jax
import numpy as np

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


def decode_steps_program(engine: Any, params: Any, k: int) -> jax.stages.Compiled:
    """The compiled program of `engine`'s k-step decode dispatch (`Engine.generate_steps`) for `params` placed on
    its devices, a fresh decode state and the sampling filters of the requests it has seen; nothing runs."""
    keys = np.zeros((int(k), 2), np.uint32)
    return engine._jit_generate_steps.lower(engine.place_params(params), engine.init_decode_state(), keys,
                                            filters=engine.sampling_filters).compile()
