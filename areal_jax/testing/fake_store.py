"""A stand-in object store for tests: `fake-gs://bucket/key` URLs kept in a local directory.

    from areal_jax.testing import fake_store
    fake_store.register(tmp_dir)             # once per process, before the paths are used
    config.run_dir = "fake-gs://bucket/run"  # everything the run writes goes through epath to tmp_dir

or, for a program in other processes: `AREAL_FAKE_STORE_ROOT=DIR python -m areal_jax.testing.fake_store
areal_jax.main --config.run_dir=fake-gs://bucket/run ...`.

It behaves like an object store where that matters to a writer, so code that only works on a local
disk fails here too: there is no append (opening for "a" raises), directories do not exist on their
own (`mkdir` is a no-op, a "directory" exists when an object lies under it), writing a key replaces
the whole object at close, and renaming a directory copies its objects one by one. `local_mount()`
gives the local directory, which is what orbax's tensorstore file driver writes checkpoint arrays to
(for gs:// it would use its own gcs driver; see paths.checkpoint_directory).
"""
from __future__ import annotations

import fnmatch
import io
import os
import shutil
from collections.abc import Iterator
from typing import IO, Any

from etils import epath
from etils.epath import stat_utils

SCHEME = "fake-gs"
_ROOT_ENV = "AREAL_FAKE_STORE_ROOT"


class _Upload(io.BytesIO):
    """Bytes written to a key: the object appears (replacing any old one) on close."""

    def __init__(self, target: str):
        super().__init__()
        self._target = target

    def close(self) -> None:
        if not self.closed:
            os.makedirs(os.path.dirname(self._target), exist_ok=True)
            tmp = f"{self._target}.upload{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(self.getvalue())
            os.replace(tmp, self._target)
        super().close()


class FakeStorePath(epath.abstract_path.Path):
    """epath.Path for `fake-gs://bucket/key`, stored under $AREAL_FAKE_STORE_ROOT."""

    def __str__(self) -> str:
        s = super().__str__()
        return s.replace(f"{SCHEME}:/", f"{SCHEME}://", 1) if s.startswith(f"{SCHEME}:/") else s

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"FakeStorePath({str(self)!r})"

    def _new(self, other: Any) -> FakeStorePath:
        return FakeStorePath(os.fspath(other))

    def local_mount(self) -> str:
        root = os.environ.get(_ROOT_ENV)
        if not root:
            raise RuntimeError(f"call areal_jax.testing.fake_store.register(directory) before using {SCHEME}:// paths.")
        return os.path.join(root, *self.parts[1:])

    # ---- reading -----------------------------------------------------------------------------------
    def exists(self) -> bool:
        return os.path.exists(self.local_mount())

    def is_dir(self) -> bool:
        return os.path.isdir(self.local_mount())

    def is_file(self) -> bool:
        return os.path.isfile(self.local_mount())

    def iterdir(self) -> Iterator[FakeStorePath]:
        for name in sorted(os.listdir(self.local_mount())):
            yield self / name

    def listdir(self) -> list[FakeStorePath]:
        return list(self.iterdir())

    def glob(self, pattern: str) -> Iterator[FakeStorePath]:
        for p in self.iterdir():
            if fnmatch.fnmatch(p.name, pattern):
                yield p

    def walk(self, *, top_down: bool = True, on_error: Any = None) -> Iterator[tuple[FakeStorePath, list, list]]:
        base = self.local_mount()
        for root, dirs, files in os.walk(base, topdown=top_down, onerror=on_error):
            rel = os.path.relpath(root, base)
            yield (self if rel == "." else self.joinpath(*rel.split(os.sep))), dirs, files

    def resolve(self, strict: bool = False) -> FakeStorePath:
        return self

    def stat(self) -> stat_utils.StatResult:
        st = os.stat(self.local_mount())
        return stat_utils.StatResult(is_directory=os.path.isdir(self.local_mount()), length=st.st_size,
                                     mtime=int(st.st_mtime), owner=None, group=None, mode=None)

    def open(self, mode: str = "r", encoding: str | None = None, errors: str | None = None,
             **kwargs: Any) -> IO:
        if "a" in mode or "+" in mode:
            raise io.UnsupportedOperation(f"{self}: an object store cannot append to or update an object (mode {mode!r}).")
        if "w" in mode:
            upload = _Upload(self.local_mount())
            return upload if "b" in mode else io.TextIOWrapper(upload, encoding="utf-8")
        return open(self.local_mount(), mode, **({} if "b" in mode else {"encoding": "utf-8"}))

    # ---- writing -----------------------------------------------------------------------------------
    def mkdir(self, mode: int | None = None, parents: bool = False, exist_ok: bool = False) -> None:
        pass  # object stores have no directories; keys are created by writing objects

    def rmdir(self) -> None:
        if self.is_dir() and not os.listdir(self.local_mount()):
            os.rmdir(self.local_mount())

    def rmtree(self, missing_ok: bool = False) -> None:
        if not self.exists() and not missing_ok:
            raise FileNotFoundError(str(self))
        shutil.rmtree(self.local_mount(), ignore_errors=True)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            os.remove(self.local_mount())
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rename(self, target: Any) -> FakeStorePath:
        return self.replace(target)

    def replace(self, target: Any) -> FakeStorePath:
        target = self._new(target)
        if self.is_dir():  # object by object, as a bucket does it
            self.copy_tree(target)
            shutil.rmtree(self.local_mount())
        else:
            self.copy(target, overwrite=True)
            self.unlink()
        return target

    def copy_tree(self, target: FakeStorePath) -> None:
        for root, _, files in os.walk(self.local_mount()):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), self.local_mount())
                (self / rel).copy(target / rel, overwrite=True)

    def copy(self, dst: Any, overwrite: bool = False) -> FakeStorePath:
        dst = self._new(dst)
        if dst.exists() and not overwrite:
            raise FileExistsError(str(dst))
        with open(self.local_mount(), "rb") as src, dst.open("wb") as out:
            shutil.copyfileobj(src, out)
        return dst


def register(root: str) -> None:
    """Serve `fake-gs://` URLs from the directory `root` in this process (and in child processes,
    through $AREAL_FAKE_STORE_ROOT, once they call register or import this module)."""
    os.makedirs(root, exist_ok=True)
    os.environ[_ROOT_ENV] = os.path.abspath(root)
    epath.register_path_cls(f"{SCHEME}://")(FakeStorePath)


if os.environ.get(_ROOT_ENV):
    register(os.environ[_ROOT_ENV])


if __name__ == "__main__":
    # `python -m areal_jax.testing.fake_store MODULE ARGS...`: run MODULE as the program with fake-gs:// URLs
    # served from $AREAL_FAKE_STORE_ROOT (how multi-process tests give each process the fake store).
    import runpy
    import sys

    if len(sys.argv) < 2 or not os.environ.get(_ROOT_ENV):
        raise SystemExit(f"usage: {_ROOT_ENV}=DIR python -m areal_jax.testing.fake_store MODULE [ARGS...]")
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
