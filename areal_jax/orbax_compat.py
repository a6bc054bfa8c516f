"""A workaround for two Python-object leaks in tensorstore that orbax triggers on every checkpoint.

Targets orbax-checkpoint 0.12.8 (the private module ``orbax.checkpoint._src.serialization.tensorstore_utils``,
its module attribute ``ts`` and its function ``get_tensorstore_raw_bytes``) with tensorstore 0.1.86:

1. ``tensorstore.KvStore.Spec(json).to_json()`` leaks about 4 Python memory blocks per call. orbax resolves
   the base KvStore spec of every array it writes that way, so a save leaks ~4 blocks per array.
   Workaround: orbax sees a ``tensorstore`` module whose ``KvStore.Spec(...).to_json()`` is resolved once per
   distinct spec (all arrays of one save share a directory, so the leak becomes one call per save).
2. ``tensorstore.experimental_collect_matching_metrics(prefix)`` leaks the lists it returns (about 9 blocks
   per metric). orbax calls it before and after every array save and restore, only to log a raw-throughput
   figure. Workaround: ``get_tensorstore_raw_bytes`` returns None, which makes orbax skip that log record.

Measured on a 61-array state (30 saves after 10 warm-up saves): about 517 blocks left per save unpatched,
23 with this workaround (tests/test_reliability_recovery.py bounds it), which adds up over a long run that
saves often. The patches are applied only while a checkpoint is saved or restored
(:func:`tensorstore_leak_workarounds`, used by ``areal_jax.checkpoint.Checkpointer``) and undone after, so
no other user of orbax in the process sees them. When the private names above are missing (another orbax
version) nothing is patched. tests/test_orbax_compat.py reproduces both leaks with the workaround off and
fails, saying to delete this module, once tensorstore no longer leaks.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import json
import threading
from types import ModuleType
from typing import Any, Iterator

__all__ = ["ORBAX_TARGET", "TENSORSTORE_TARGET", "active", "tensorstore_leak_workarounds"]

ORBAX_TARGET = "0.12.8"  # orbax-checkpoint version whose private names are patched
TENSORSTORE_TARGET = "0.1.86"  # tensorstore version whose leaks this works around


class _KvStoreWithResolvedSpecs:
    """``tensorstore.KvStore`` whose ``Spec(json).to_json()`` is resolved once per distinct spec (a few recent
    ones are remembered). Everything else is the real ``KvStore``."""

    _KEEP = 16

    def __init__(self, kvstore: Any):
        self._kvstore = kvstore
        self._resolved: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kvstore, name)

    def open(self, spec: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(spec, _ResolvedSpec):
            spec = spec._real  # tensorstore wants its own Spec type here
        return self._kvstore.open(spec, *args, **kwargs)

    def Spec(self, spec: Any) -> Any:  # noqa: N802 (tensorstore's name)
        real = self._kvstore.Spec(spec)
        if not isinstance(spec, dict):
            return real
        return _ResolvedSpec(real, self, json.dumps(spec, sort_keys=True, default=str))

    def resolve(self, key: str, real: Any) -> dict:
        with self._lock:
            hit = self._resolved.get(key)
            if hit is not None:
                self._resolved.move_to_end(key)
                return copy.deepcopy(hit)
        resolved = real.to_json()
        with self._lock:
            self._resolved[key] = copy.deepcopy(resolved)
            while len(self._resolved) > self._KEEP:
                self._resolved.popitem(last=False)
        return resolved


class _ResolvedSpec:
    """A real ``KvStore.Spec`` whose argument-less ``to_json()`` goes through the owner's cache."""

    def __init__(self, real: Any, owner: _KvStoreWithResolvedSpecs, key: str):
        self._real, self._owner, self._key = real, owner, key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def to_json(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._real.to_json(*args, **kwargs)
        return self._owner.resolve(self._key, self._real)


class _TensorStoreModule:
    """The ``tensorstore`` module as orbax's tensorstore_utils sees it while patched, with ``KvStore`` wrapped."""

    def __init__(self, module: ModuleType):
        self._module = module
        self.KvStore = _KvStoreWithResolvedSpecs(module.KvStore)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _no_raw_bytes(direction: Any = None) -> None:
    """Stands in for orbax's ``get_tensorstore_raw_bytes``: None makes orbax skip its throughput log."""
    del direction
    return None


_lock = threading.Lock()
_depth = 0  # saves / restores inside the scope now (threads may overlap)
_saved: dict[str, Any] = {}  # the originals, while patched
_wrapped_ts: _TensorStoreModule | None = None  # kept across scopes, so its spec cache outlives one save


def _target_module() -> ModuleType | None:
    """orbax's tensorstore_utils when it has both names this module patches, else None."""
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils
    except ImportError:
        return None
    ts = getattr(tensorstore_utils, "ts", None)
    if ts is None or not hasattr(ts, "KvStore") or not hasattr(tensorstore_utils, "get_tensorstore_raw_bytes"):
        return None
    return tensorstore_utils


def active() -> bool:
    """Whether orbax currently sees the patched names (inside a :func:`tensorstore_leak_workarounds` scope)."""
    with _lock:
        return bool(_saved)


@contextlib.contextmanager
def tensorstore_leak_workarounds() -> Iterator[None]:
    """Patch orbax's tensorstore_utils for the ``with`` body (re-entrant, thread-safe); undone when the last
    overlapping scope exits. Wrap every orbax save and restore in it."""
    global _depth, _wrapped_ts
    with _lock:
        if _depth == 0:
            module = _target_module()
            if module is not None:
                if _wrapped_ts is None or _wrapped_ts._module is not module.ts:
                    _wrapped_ts = _TensorStoreModule(module.ts)
                _saved.update(module=module, ts=module.ts, raw_bytes=module.get_tensorstore_raw_bytes)
                module.ts = _wrapped_ts
                module.get_tensorstore_raw_bytes = _no_raw_bytes
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved:
                module = _saved["module"]
                module.ts, module.get_tensorstore_raw_bytes = _saved["ts"], _saved["raw_bytes"]
                _saved.clear()
