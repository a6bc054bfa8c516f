"""One path layer for everything a run writes: local directories, `file://` URLs and object stores.

`run_dir` may be a local path, a `file:///abs/path` URL, or an object-store URL that etils.epath
handles (`gs://bucket/run` with `gcsfs` installed, or any scheme registered with
`epath.register_path_cls`). Every writer of the run (metrics, samples, summary, timeline, plots,
checkpoints and their per-process metadata) goes through the functions here, so the same code runs on
a laptop and on a pod whose workers share no disk:

- whole files (config.json, summary.json, checkpoint metadata, plots, timeline.json) are written in
  one piece: locally to a temporary name and renamed, on an object store as one upload (an object
  becomes visible only when its upload completes, so readers never see half of it);
- append-only logs (metrics.jsonl, samples*.jsonl, params digests) are `AppendFile`s: appended and
  flushed in place locally; on an object store (which has no append) appended to a node-local mirror
  and uploaded whole at most every `sync_interval_s` and whenever `sync()` is called (the job calls
  it before every checkpoint, so a resume finds every line of the steps it restores);
- directories other libraries write into (TensorBoard events) are `MirroredDir`s: a node-local
  directory uploaded file by file on `sync()`.

Node-local scratch space: $AREAL_JAX_SCRATCH, else the system temporary directory.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from typing import IO, Any

from etils import epath

ENV_SCRATCH = "AREAL_JAX_SCRATCH"
PathLike = str | os.PathLike


def run_path(path: PathLike) -> epath.Path:
    """`path` as an epath.Path: `file://` URLs become local paths, other URLs keep their scheme.

    Raises ValueError, naming --config.run_dir, for a URL scheme no installed backend handles.
    """
    if isinstance(path, epath.Path):
        return path
    s = os.fspath(path)
    if s.startswith("file://"):
        parsed = urllib.parse.urlparse(s)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{s!r} names the host {parsed.netloc!r}; a file:// URL must be local "
                             "(file:///absolute/path), e.g. --config.run_dir=file:///tmp/run.")
        return epath.Path(urllib.parse.unquote(parsed.path))
    if "://" in s:
        scheme = s.split("://", 1)[0]
        try:
            return epath.Path(s)
        except KeyError:
            raise ValueError(
                f"{s!r} uses the scheme {scheme}://, which no installed storage backend handles; use a local "
                "path, a file:///absolute/path URL or gs://bucket/path (pip install gcsfs), e.g. "
                "--config.run_dir=gs://my-bucket/runs/math."
            ) from None
    return epath.Path(s)


def is_local(path: PathLike) -> bool:
    """True when `path` lives on this machine's filesystem (a plain path or a file:// URL)."""
    return "://" not in os.fspath(run_path(path))


def local_path(path: PathLike) -> str | None:
    """The local filesystem path of `path`, or None for an object store."""
    p = run_path(path)
    return os.fspath(p) if is_local(p) else None


def join(base: PathLike, *parts: str) -> epath.Path:
    return run_path(base).joinpath(*parts)


def makedirs(path: PathLike) -> None:
    """Create the directory and its parents (object stores have no directories: a no-op there)."""
    run_path(path).mkdir(parents=True, exist_ok=True)


def exists(path: PathLike) -> bool:
    return run_path(path).exists()


def read_text(path: PathLike) -> str:
    return run_path(path).read_text()


def read_json(path: PathLike) -> Any:
    return json.loads(read_text(path))


@contextlib.contextmanager
def atomic_open(path: PathLike, mode: str = "w") -> Iterator[IO]:
    """Write a whole file so readers see the old content or the new, never half of it.

    Local: a temporary name in the same directory, renamed over `path` when the block ends without
    an exception. Object store: a node-local temporary file, uploaded as one object when the block
    ends without an exception (a store's own writer would publish a half-written object on error).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode must be 'w' or 'wb', not {mode!r}.")
    p = run_path(path)
    remote = not is_local(p)
    target = os.fspath(p)
    tmp = os.path.join(scratch_dir(p, "upload"), p.name) if remote else f"{target}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        if remote:
            _upload(tmp, p)
        else:
            os.replace(tmp, target)
    finally:
        if remote:
            shutil.rmtree(os.path.dirname(tmp), ignore_errors=True)
        elif os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: PathLike, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def write_json(path: PathLike, obj: Any) -> None:
    """Write JSON atomically (see atomic_open)."""
    write_text(path, json.dumps(obj, indent=1, default=str))


def scratch_dir(path: PathLike, kind: str) -> str:
    """A node-local directory that stands in for `path` (an object-store location) for `kind` of data
    (e.g. "mirror", "spool"); distinct per remote path and per process, created empty."""
    key = hashlib.sha256(os.fspath(run_path(path)).encode()).hexdigest()[:16]
    root = os.environ.get(ENV_SCRATCH) or tempfile.gettempdir()
    d = os.path.join(root, "areal_jax", f"{kind}-{key}-{os.getpid()}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def _upload(local: str, remote: epath.Path) -> None:
    with open(local, "rb") as src, remote.open("wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)


class AppendFile:
    """An append-only text file (JSONL logs) on local disk or an object store.

    Local: appended and flushed on every write (a kill leaves at most one torn last line).
    Object store: appended to a node-local mirror, which starts as a copy of the object if it exists
    (a resumed run continues the file), and uploaded whole by `sync()`; `write` syncs when
    `sync_interval_s` has passed since the last upload. Not shared between processes: give each
    process its own file.
    """

    def __init__(self, path: PathLike, *, sync_interval_s: float = 30.0):
        self.path = run_path(path)
        self.remote = not is_local(self.path)
        self.sync_interval_s = sync_interval_s
        self._last_sync = time.monotonic()
        self._dirty = False
        if self.remote:
            self._local = os.path.join(scratch_dir(self.path, "mirror"), self.path.name)
            if self.path.exists():
                with self.path.open("rb") as src, open(self._local, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 20)
        else:
            self._local = os.fspath(self.path)
            os.makedirs(os.path.dirname(os.path.abspath(self._local)), exist_ok=True)
        self._f: IO[str] | None = open(self._local, "a", encoding="utf-8")

    def write(self, text: str) -> None:
        """Append `text` (whole lines) and flush it to the local file."""
        if self._f is None:
            raise RuntimeError(f"AppendFile {self.path} is closed.")
        self._f.write(text)
        self._f.flush()
        self._dirty = True
        if self.remote and time.monotonic() - self._last_sync >= self.sync_interval_s:
            self.sync()

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def sync(self) -> None:
        """Make everything written so far durable where `path` points (uploads on an object store)."""
        self.flush()
        if self.remote and self._dirty:
            _upload(self._local, self.path)
        self._dirty = False
        self._last_sync = time.monotonic()

    def read_text(self) -> str:
        """The file's content as written so far."""
        self.flush()
        with open(self._local, encoding="utf-8") as f:
            return f.read()

    def rewrite(self, text: str) -> None:
        """Replace the whole content (atomically locally; uploaded at once on an object store)."""
        if self._f is not None:
            self._f.close()
        tmp = self._local + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, self._local)
        self._f = open(self._local, "a", encoding="utf-8")
        self._dirty = True
        self.sync()

    def close(self) -> None:
        if self._f is None:
            return
        self.sync()
        self._f.close()
        self._f = None
        if self.remote:
            shutil.rmtree(os.path.dirname(self._local), ignore_errors=True)


class MirroredDir:
    """A directory another library writes into by local path (e.g. TensorBoard event files).

    `local` is `path` itself when it is local; for an object store it is a node-local directory whose
    files `sync()` uploads (those whose size or modification time changed since the last upload).
    """

    def __init__(self, path: PathLike):
        self.path = run_path(path)
        self.remote = not is_local(self.path)
        self.local = scratch_dir(self.path, "mirror") if self.remote else os.fspath(self.path)
        os.makedirs(self.local, exist_ok=True)
        self._uploaded: dict[str, tuple[int, int]] = {}

    def sync(self) -> list[str]:
        """Upload new or changed files; returns their relative names."""
        if not self.remote:
            return []
        done = []
        for root, _, files in os.walk(self.local):
            for name in sorted(files):
                src = os.path.join(root, name)
                rel = os.path.relpath(src, self.local)
                st = os.stat(src)
                sig = (st.st_size, st.st_mtime_ns)
                if self._uploaded.get(rel) == sig:
                    continue
                _upload(src, self.path.joinpath(*rel.split(os.sep)))
                self._uploaded[rel] = sig
                done.append(rel)
        return done

    def close(self) -> None:
        self.sync()
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)


# Object-store schemes etils.epath serves through fsspec, and the package each one needs.
_FSSPEC_PACKAGES = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs"}


def check_backend(path: PathLike) -> None:
    """Raise ValueError, naming the package to install, when `path`'s object store has no client here
    (epath reaches gs:// through gcsfs, or through TensorFlow's gfile when TensorFlow is installed)."""
    import importlib.util

    s = os.fspath(run_path(path))
    scheme = s.split("://", 1)[0] if "://" in s else None
    package = _FSSPEC_PACKAGES.get(scheme or "")
    if package is None or importlib.util.find_spec(package) or importlib.util.find_spec("tensorflow"):
        return
    raise ValueError(f"{s!r} needs the {package} package to reach {scheme}:// (pip install {package}"
                     + (", or pip install -e '.[gcs]'" if scheme == "gs" else "") + ").")


def checkpoint_directory(path: PathLike) -> str:
    """The directory string orbax (and its tensorstore drivers) should write checkpoints to.

    Local paths become absolute; gs:// URLs go to orbax unchanged (tensorstore's gcs driver writes the
    arrays); a path whose class has `local_mount()` (a store mounted on this machine, such as the test
    store in areal_jax.testing.fake_store) gives that local directory. orbax 0.12.8 sends every other URL to
    tensorstore's file driver, which would write into a directory named after the URL, so those are
    refused with a ValueError naming --config.run_dir.
    """
    p = run_path(path)
    if is_local(p):
        return os.path.abspath(os.fspath(p))
    s = os.fspath(p)
    if s.startswith("gs://"):
        return s
    mount = getattr(p, "local_mount", None)
    if mount is not None:
        return mount()
    raise ValueError(
        f"checkpoints cannot be written to {s!r}: orbax writes arrays to local paths and gs:// only; use "
        "--config.run_dir=gs://bucket/path or a local / mounted directory."
    )
