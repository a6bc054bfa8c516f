"""Which engine compiled what, and what a compiled dispatch costs.

Compilations are attributed through JAX's monitoring events: while an engine runs one of its jitted
functions (`compiles_counted_for(engine)`), every backend compile on that thread adds one to its
`_compiles` counter, which `Engine.compile_count` reports. `decode_steps_program` compiles an engine's k-step
decode dispatch ahead of time for XLA's cost analysis and program text (benchmarks, tests).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

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


class CountedPrograms:
    """How an engine runs its jitted programs (mixed into the Engine): `_call` attributes the compiles a call
    triggers to the engine, and both it and `_lower` pass the arguments the engine adds to a program
    (`_program_kwargs`: none for the dense engine; the paged engine's page table)."""

    _compiles: int = 0

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a jitted function, attributing any compilation it triggers to this engine."""
        with compiles_counted_for(self):
            return fn(*args, **self._program_kwargs(fn), **kwargs)

    def _lower(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lower a jitted function for these arguments as `_call` would run it (nothing runs)."""
        return fn.lower(*args, **self._program_kwargs(fn), **kwargs)

    def _program_kwargs(self, fn: Callable[..., Any]) -> dict[str, Any]:
        """Keyword arguments the engine adds to every call of `fn`."""
        return {}

    @property
    def compile_count(self) -> int:
        """XLA programs compiled so far by this engine's jitted functions."""
        return self._compiles


def decode_steps_program(engine: Any, params: Any, k: int) -> jax.stages.Compiled:
    """The compiled program of `engine`'s k-step decode dispatch (`Engine.generate_steps`) for `params` placed on
    its devices, a fresh decode state and the sampling filters of the requests it has seen; nothing runs."""
    keys = np.zeros((int(k), 2), np.uint32)
    return engine._lower(engine._jit_generate_steps, engine.place_params(params), engine.init_decode_state(), keys,
                         filters=engine.sampling_filters).compile()
