"""Timeline: a Chrome trace recorder (spans on named lanes), and the small interface its users call.

``with timeline.span("decode_step", lane="sampler", batch=8): ...`` records a span; open the saved
``timeline.json`` in https://ui.perfetto.dev or chrome://tracing. Thread-safe and memory-bounded (see
:class:`Timeline`). Parts that record into a timeline (the sampler loop, the rollout controller) take any
:class:`SpanRecorder`, so tests can hand them a fake.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from typing import Any, ContextManager, Iterator, Protocol, runtime_checkable

from areal_jax import paths

__all__ = ["SpanRecorder", "Timeline"]


@runtime_checkable
class SpanRecorder(Protocol):
    """Records timed spans on named lanes (one lane per thread: "sampler", "trainer", "rewards")."""

    def span(self, name: str, lane: str | None = None, **args: Any) -> ContextManager[None]:
        """Time the ``with`` body as one span named ``name`` on ``lane``; ``args``: JSON-able labels."""
        ...

    def complete(self, name: str, seconds: float, lane: str | None = None, **args: Any) -> None:
        """Record a span of ``seconds`` (timed elsewhere) that ended now."""
        ...


class Timeline:
    """Chrome trace recorder: spans on named lanes, saved as ``{"traceEvents": [...]}`` JSON.

    Each lane is one row ("thread") in the viewer; give a lane to one thread at a time (the default
    lane is the current thread's name) so its spans nest. Spans are complete events ("ph": "X") with
    integer microsecond timestamps from a monotonic clock, floor-rounded so a span that encloses
    another in time also does so in the file.

    Memory bound: at most ``max_buffered`` events are held in memory. With a ``path`` they are then
    appended to a spool file (``path + ".spool"``) and ``save()`` streams spool + buffer into
    ``path``; without a path the oldest events are dropped. At most ``max_events`` events are kept in
    total; later ones are dropped and counted (``dropped``, and ``otherData`` in the file).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, enabled: bool = True,
                 max_buffered: int = 256, max_events: int = 1_000_000,
                 process_name: str = "areal_jax") -> None:
        if max_buffered < 1 or max_events < 1:
            raise ValueError("Timeline needs max_buffered >= 1 and max_events >= 1.")
        self.path = os.fspath(paths.run_path(path)) if path is not None else None
        self.enabled = enabled
        self.max_buffered = max_buffered
        self.max_events = max_events
        self.process_name = process_name
        self.dropped = 0
        self._lock = threading.Lock()
        self._buffer: list[dict] = []
        self._recorded = 0  # events kept (buffer + spool)
        self._closed = False
        self._lanes: dict[str, int] = {}
        self._pid = os.getpid()
        self._t0_ns = time.perf_counter_ns()
        self._spool_path = None  # always on local disk (node-local scratch for an object store)
        if self.path is not None:
            self._spool_path = (self.path + ".spool" if paths.is_local(self.path) else
                                os.path.join(paths.scratch_dir(self.path, "spool"), "timeline.json.spool"))
        if self._spool_path and os.path.exists(self._spool_path):
            os.remove(self._spool_path)

    def _now_us(self) -> int:
        return (time.perf_counter_ns() - self._t0_ns) // 1000

    def _lane_id(self, lane: str | None) -> int:
        name = lane if lane is not None else threading.current_thread().name
        tid = self._lanes.get(name)
        if tid is None:
            tid = self._lanes[name] = len(self._lanes) + 1
        return tid

    def _record(self, event: dict) -> None:
        with self._lock:
            event["tid"] = self._lane_id(event.pop("lane"))
            if self.path is None and len(self._buffer) >= self.max_buffered:
                self._buffer.pop(0)
                self._recorded -= 1
                self.dropped += 1
            if self._recorded >= self.max_events:
                self.dropped += 1
                return
            self._buffer.append(event)
            self._recorded += 1
            if self.path is not None and len(self._buffer) >= self.max_buffered:
                self._spool_locked()

    def _spool_locked(self) -> None:
        with open(self._spool_path, "a", encoding="utf-8") as f:
            for event in self._buffer:
                f.write(json.dumps(event, default=str) + "\n")
        self._buffer.clear()

    @contextlib.contextmanager
    def span(self, name: str, lane: str | None = None, **args: Any) -> Iterator[None]:
        """Time the ``with`` body as one span named ``name`` on ``lane``; ``args`` are shown in the
        viewer (JSON-able values; others are written as str). Recorded even if the body raises."""
        if not self.enabled:
            yield
            return
        start = self._now_us()
        try:
            yield
        finally:
            end = self._now_us()
            self._record({"name": name, "ph": "X", "ts": start, "dur": end - start,
                          "pid": self._pid, "lane": lane, "args": args})

    def complete(self, name: str, seconds: float, lane: str | None = None, **args: Any) -> None:
        """A span of ``seconds`` that ended now (work timed elsewhere, e.g. in a reward worker)."""
        if self.enabled:
            end = self._now_us()
            dur = max(0, int(seconds * 1e6))
            self._record({"name": name, "ph": "X", "ts": max(0, end - dur), "dur": dur,
                          "pid": self._pid, "lane": lane, "args": args})

    def instant(self, name: str, lane: str | None = None, **args: Any) -> None:
        """A point event (e.g. "weights_updated") on ``lane``."""
        if self.enabled:
            self._record({"name": name, "ph": "i", "s": "t", "ts": self._now_us(),
                          "pid": self._pid, "lane": lane, "args": args})

    def events(self) -> list[dict]:
        """Events still in memory (all of them when there is no path)."""
        with self._lock:
            return list(self._buffer)

    def _metadata_locked(self) -> list[dict]:
        meta = [{"name": "process_name", "ph": "M", "pid": self._pid, "tid": 0,
                 "args": {"name": self.process_name}}]
        for lane, tid in self._lanes.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid,
                         "args": {"name": lane}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": self._pid, "tid": tid,
                         "args": {"sort_index": tid}})
        return meta

    def save(self, path: str | os.PathLike | None = None) -> str:
        """Write the trace so far (valid Chrome trace JSON) to ``path`` (default: the constructor's)
        atomically; may be called repeatedly. Returns the path written."""
        target = os.fspath(path) if path is not None else self.path
        if target is None:
            raise ValueError("Timeline.save() needs a path: pass one here or to Timeline(path).")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"this Timeline is closed; its trace was saved to {self.path}.")
            if self._spool_path is not None and self._buffer:
                self._spool_locked()
            with paths.atomic_open(target) as out:
                out.write('{"traceEvents": [\n')
                lines = [json.dumps(e) for e in self._metadata_locked()]
                out.write(",\n".join(lines))
                if self._spool_path is not None and os.path.exists(self._spool_path):
                    with open(self._spool_path, encoding="utf-8") as spool:
                        for line in spool:  # streamed: memory stays bounded
                            out.write(",\n" + line.rstrip("\n"))
                for event in self._buffer:  # only when there is no spool (no path)
                    out.write(",\n" + json.dumps(event, default=str))
                other = {"dropped_events": self.dropped, "clock": "monotonic, us since start"}
                out.write(f'\n], "displayTimeUnit": "ms", "otherData": {json.dumps(other)}}}\n')
        return target

    def close(self) -> None:
        """Save (when there is a path), remove the spool file and stop recording."""
        if self.path is not None:
            self.save()
        with self._lock:
            self.enabled = False
            self._closed = True
            if self._spool_path and os.path.exists(self._spool_path):
                os.remove(self._spool_path)
            if self.path is not None and not paths.is_local(self.path) and self._spool_path:
                shutil.rmtree(os.path.dirname(self._spool_path), ignore_errors=True)  # its scratch dir
