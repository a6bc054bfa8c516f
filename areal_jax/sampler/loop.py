"""The continuous-batching sampler loop: a thin thread around the pure :class:`Engine`.

The thread keeps every decode slot busy: between two dispatches it applies a pending weight
update, handles aborts, and admits queued requests into free slots (a request's n samples share
one prefill). Each dispatch runs ``decode_steps`` (k) decode steps on the device
(:meth:`Engine.generate_steps`; stop tokens and length limits are checked there) and its small
[k, slots] result is fetched once. With ``fetch_behind`` the loop issues dispatch i+1 before it
fetches dispatch i, so the host's fetch and bookkeeping overlap the device's work; a slot freed inside
dispatch i is refilled before dispatch i+2 (it idles for the rest of dispatch i and for dispatch i+1),
unless the engine has standby rows: queued samples then wait prefilled on the device and take a slot the
step after it frees (``sampler.standby``). So k bounds the latency an admission, an abort or a weight
update adds: about one dispatch (two with fetch-behind). Every generated token carries the version of the params whose logits it was
sampled from.

On ``update_params`` with ``on_update="recompute"`` each in-flight sequence (prompt + tokens so
far) is prefilled again under the new params before decoding continues: AReaL's interruptible
generation. With ``"continue"`` the stale KV cache is kept, and so are the prefixes of queued and staged
samples prefilled before the update (their first token carries the version that prefilled them).
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import threading
import time
import weakref
from typing import Any, Callable, Hashable, Literal

from flax import nnx

from areal_jax.models.flat_params import FlatParams, check_same_layout
from areal_jax.sampler.dispatch import Dispatch, KeyStream
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.loop_thread import LoopThread
from areal_jax.sampler.requests import (
    Completion,
    Request,
    SamplerLoopError,
    _Queued,
    _Running,
    make_completion,
)
from areal_jax.sampler.sampling import SamplingParams
from areal_jax.timeline import SpanRecorder

_LIVE_LOOPS: "weakref.WeakSet[SamplerLoop]" = weakref.WeakSet()


@atexit.register
def _stop_live_loops() -> None:
    """Stop loops still running at interpreter exit, so no thread is inside XLA during teardown."""
    for loop in list(_LIVE_LOOPS):
        with loop._cond:
            loop._stop_mode = "now"
            loop._cond.notify_all()
        loop._thread.join(timeout=10)


class SamplerLoop(LoopThread):
    """Daemon thread that serves :class:`Request` objects with continuous batching.

    This class is what callers use from any thread; what the loop's own thread runs is
    :class:`~areal_jax.sampler.loop_thread.LoopThread`."""

    def __init__(self, engine: Engine, params: nnx.State, *, version: int = 0,
                 on_update: Literal["recompute", "continue"] = "recompute", seed: int = 0,
                 decode_steps: int = 1, fetch_behind: bool = True, timeline: SpanRecorder | None = None,
                 lane: str = "sampler", on_emit: Callable[[], None] | None = None,
                 record_routes: bool = False) -> None:
        """Start the loop thread.

        Args:
          engine: the Engine whose slots the loop fills.
          params: model state (``nnx.split(model)[1]``) of version ``version``.
          on_update: "recompute" (re-prefill in-flight sequences under new params) or "continue".
          seed: PRNG seed of the sampling noise.
          decode_steps: k, decode steps per dispatch (>= 1); 1 on CPU, 8-32 on accelerators.
          fetch_behind: issue the next dispatch before fetching the previous one's results.
          timeline: where decode steps and updates are recorded as spans (None: nowhere).
          lane: the timeline lane of those spans.
          on_emit: called (from the loop's thread, holding the loop's lock: it must not call back into the loop)
            whenever a completion becomes ready.
          record_routes: a mixture-of-experts model's finished samples carry `Completion.routes`, the experts its
            prefill and decode steps sent each token to (`sampler.routes`).
        """
        if on_update not in ("recompute", "continue"):
            raise ValueError(f'on_update must be "recompute" or "continue", got {on_update!r}.')
        if int(decode_steps) < 1:
            raise ValueError(f"decode_steps must be at least 1 (decode steps per dispatch), got {decode_steps}.")
        self.engine, self.on_update = engine, on_update
        if record_routes and not getattr(engine.config, "num_experts", 0):
            raise ValueError("record_routes needs a mixture-of-experts model: this one has no experts.")
        self.record_routes = bool(record_routes)
        self.decode_steps, self.fetch_behind = int(decode_steps), bool(fetch_behind)
        self._inflight: collections.deque[Dispatch] = collections.deque()
        self._params, self._version = engine.place_params(params), int(version)
        # Longest prompt + generation a slot may hold; recompute must re-prefill up to one less.
        top = engine.prefill_buckets[-1]
        refill = on_update == "recompute" or getattr(engine, "admission", "reserve") == "optimistic"
        self._max_total = min(engine.max_len, top + 1) if refill else engine.max_len
        self._max_prompt = min(top, self._max_total - 1)
        self._keys = KeyStream(seed)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Queued] = collections.deque()
        self._out: collections.deque[Completion] = collections.deque()
        self._running: dict[int, _Running] = {}
        self._free = list(range(engine.num_slots))[::-1]
        self._standby: dict[int, _Running] = {}
        self._standby_free = list(range(getattr(engine, "standby_rows", 0)))[::-1]
        self._pending_update: tuple[FlatParams, int, float] | None = None
        self._aborts: set[Hashable] = set()
        self._paused = self._idle = False
        self._stop_mode: str | None = None
        self._error: BaseException | None = None
        self._pending = 0
        self._stats = collections.Counter()
        self._max_update_wait = 0.0
        self._state = engine.init_decode_state()
        self.timeline, self.lane = timeline, lane  # records decode steps and updates (areal_jax.timeline)
        self.on_emit = on_emit
        self._thread = threading.Thread(target=self._run, name="sampler-loop", daemon=True)
        self._thread.start()
        _LIVE_LOOPS.add(self)

    # ------------------------------------------------------------------ caller-side API
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise SamplerLoopError(f"the sampler loop thread failed: {self._error!r}") from self._error

    def check(self) -> None:
        """Raise SamplerLoopError (caused by the thread's exception) when the loop thread has failed."""
        self._raise_if_failed()

    @property
    def alive(self) -> bool:
        """Whether the loop thread still runs (False once stopped, or failed: ``check`` then raises)."""
        return self._thread.is_alive()

    def submit(self, request: Request) -> None:
        """Queue ``request``; a prompt that cannot fit comes back as "error" completions."""
        self._raise_if_failed()
        if int(request.n) < 1:
            raise ValueError(f"Request {request.id!r}: n must be >= 1, got {request.n}.")
        sampling = SamplingParams(request.temperature, request.top_k, request.top_p,
                                  request.max_new_tokens, request.stop_token_ids)
        self.engine.settings(sampling)  # validates the number of stop ids
        length, error = len(request.prompt), None
        if length == 0:
            error = f"Request {request.id!r} has an empty prompt; give at least one token."
        elif length > self._max_prompt:
            error = (f"Request {request.id!r}: the prompt has {length} tokens but this sampler holds at most "
                     f"{self._max_prompt} prompt tokens (max_len={self.engine.max_len}); shorten the prompt "
                     "or build the Engine with a larger max_len.")
        elif length + sampling.max_new_tokens > self._max_total:
            sampling = dataclasses.replace(sampling, max_new_tokens=self._max_total - length)
        with self._cond:
            if self._stop_mode is not None:
                raise RuntimeError("submit() called after stop(); create a new SamplerLoop.")
            self._pending += request.n
            if error is not None:
                for i in range(request.n):
                    self._emit_locked(make_completion(request, i, reason="error", error=error))
            else:
                self._queue.append(_Queued(request, sampling))
            self._cond.notify_all()

    def get_completion(self, timeout: float | None = None) -> Completion | None:
        """Next finished sample, or None after ``timeout`` seconds (or when stopped and drained)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_failed()
                if self._out:
                    return self._out.popleft()
                if not self._thread.is_alive():
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def update_params(self, params: nnx.State | FlatParams, version: int) -> None:
        """Swap in new params at the next step boundary (non-blocking; the latest call wins).

        Raises ValueError at once when ``params`` does not have the structure, shapes and dtypes
        of the params the loop was built with."""
        self._raise_if_failed()
        params = FlatParams.of(params)
        check_same_layout(self._params, params)
        with self._cond:
            self._pending_update = (params, int(version), time.monotonic())
            self._cond.notify_all()

    @property
    def params(self) -> nnx.State:
        """The params the loop decodes with now (on the engine's mesh)."""
        return self._params.tree()

    def versioned_params(self) -> tuple[int, nnx.State]:
        """(version, params) the loop decodes with now, read together."""
        with self._cond:
            version, params = self._version, self._params
        return version, params.tree()

    @property
    def current_version(self) -> int:
        """Version of the params the loop decodes with now."""
        return self._version

    def pause(self) -> None:
        """Stop stepping; returns once the loop is idle between two steps."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            while not self._idle and self._thread.is_alive():
                self._cond.wait(0.1)
            self._raise_if_failed()

    def resume(self) -> None:
        """Continue after :meth:`pause`."""
        with self._cond:
            self._paused = self._idle = False
            self._cond.notify_all()

    def abort(self, request_id: Hashable) -> None:
        """Drop a request: its queued and running samples come back as "interrupted"."""
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify_all()

    def request_stop(self, graceful: bool = True) -> None:
        """Tell the thread to end (as :meth:`stop`) without waiting for it."""
        with self._cond:
            if self._stop_mode != "now":
                self._stop_mode = "graceful" if graceful else "now"
            self._paused = False
            self._cond.notify_all()

    def stop(self, graceful: bool = True, timeout: float | None = None) -> None:
        """End the thread. graceful: finish everything submitted first; else in-flight and queued
        samples come back as "interrupted". Re-raises a failure of the thread."""
        self.request_stop(graceful)
        self._thread.join(timeout)
        self._raise_if_failed()

    def num_pending(self) -> int:
        """Samples submitted and not yet handed back as completions (queued + running + unread)."""
        with self._cond:
            return self._pending - len(self._out)

    def stats(self) -> dict[str, float]:
        """Counters: steps (device decode steps), dispatches, generated_tokens, mean_slot_occupancy
        (generating slot-steps / (steps * slots)), queue_depth, running, standby, placed_from_standby,
        preempted (samples that gave their pages back, ``sampler.preempt``), recomputes, updates,
        update_latency_s / update_latency_max_s (update_params call to the update taking effect),
        compile_count, version."""
        with self._cond:
            s = dict(self._stats)
            queued = sum(q.remaining for q in self._queue)
            steps = s.get("steps", 0)
            return {
                "steps": steps,
                "dispatches": s.get("dispatches", 0),
                "generated_tokens": s.get("generated_tokens", 0),
                "mean_slot_occupancy": s.get("busy_slot_steps", 0) / max(1, steps * self.engine.num_slots),
                "queue_depth": queued,
                "running": len(self._running),
                "standby": len(self._standby),
                "placed_from_standby": s.get("placed", 0),
                "preempted": s.get("preempted", 0),
                "recomputes": s.get("recomputes", 0),
                "updates": s.get("updates", 0),
                "update_latency_s": s.get("update_wait_s", 0.0) / max(1, s.get("updates", 0)),
                "update_latency_max_s": self._max_update_wait,
                "compile_count": self.engine.compile_count,
                "version": self._version,
            }

    def __enter__(self) -> "SamplerLoop":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop(graceful=False)
