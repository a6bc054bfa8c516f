"""Save and resume everything a run needs to continue exactly, with orbax.

A checkpoint at step k holds:
- `state`: the trainer's TrainState (params, optimizer state, step, version), saved sharded (on many
  hosts every process writes its own shards; orbax coordinates);
- `meta` (JSON, one file per process, since each process has its own prompt shard and rollouts):
  version, the controller's pending prompts (admitted but not yet trained, in admission order), the
  prompt iterator's state, counters and the RNG seed.
The run directory may be local, a file:// URL or an object store (areal_jax.paths): the meta files go
through epath, the state through orbax (gs:// natively, with tensorstore's gcs driver).
The meta files are written (atomically, by rename) before the state, and orbax writes each step into a
temporary directory that it renames only when complete. So a checkpoint cut short by a crash is never
listed, let alone loaded: `latest_step()` only sees finished ones, and those always have their meta.
Saves and restores run inside areal_jax.orbax_compat's scoped workaround for two tensorstore leaks.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import jax
import orbax.checkpoint as ocp

from areal_jax import paths
from areal_jax.knobs import Section, knob, require
from areal_jax.orbax_compat import tensorstore_leak_workarounds


def _abstract(tree: Any) -> Any:
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


class Checkpointer:
    """Numbered checkpoints under `<run_dir>/checkpoints`, keeping the newest `keep`."""

    def __init__(self, run_dir: str, *, keep: int = 2):
        self.run_dir = paths.run_path(run_dir)
        self.directory = paths.checkpoint_directory(self.run_dir / "checkpoints")
        self.meta_root = self.run_dir / "checkpoint_meta"
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        self._mngr.reload()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        self._mngr.reload()
        return list(self._mngr.all_steps())

    def _meta_path(self, step: int) -> Any:
        return self.meta_root / str(step) / f"process_{jax.process_index()}.json"

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write checkpoint `step` (blocking; the rename at the end makes it visible atomically)."""
        path = self._meta_path(step)
        paths.makedirs(path.parent)
        write_json(path, meta)
        with tensorstore_leak_workarounds():  # areal_jax/orbax_compat.py
            self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)
            self._mngr.wait_until_finished()
        self._prune_meta()

    def _prune_meta(self) -> None:
        """Remove this process's meta files of steps orbax no longer keeps (bounded disk use)."""
        kept = {str(s) for s in self.all_steps()}
        for step_dir in self.meta_root.iterdir():
            name = step_dir.name
            if name in kept or not name.isdigit():
                continue
            own = f"process_{jax.process_index()}.json"
            try:
                for f in list(step_dir.iterdir()):
                    if f.name == own or f.name.startswith(own + ".tmp"):  # with a temporary left by a kill
                        f.unlink(missing_ok=True)
                step_dir.rmdir()
            except (OSError, ValueError):
                pass  # other processes' files are still there, or another process removed the directory

    def restore(self, step: int, like_state: Any) -> tuple[Any, dict]:
        """Load checkpoint `step` into the structure, shapes and shardings of `like_state`."""
        path = self._meta_path(step)
        if not path.exists():
            raise FileNotFoundError(
                f"Checkpoint step {step} in {self.directory} has no metadata file {path}; it was not written "
                "by this code or the file was removed. Restore the file, or move that step away to resume "
                "from an earlier one."
            )
        meta = json.loads(path.read_text())
        with tensorstore_leak_workarounds():
            restored = self._mngr.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(like_state)))
            )
        return restored["state"], meta

    def close(self) -> None:
        self._mngr.close()


def example_to_json(example: Any) -> dict:
    """A PromptExample (dataclass) as a JSON-serialisable dict."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(example).items()}


def write_json(path: Any, obj: Any) -> None:
    """Write JSON atomically: a temporary file renamed locally, one upload on an object store."""
    paths.write_json(path, obj)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """When to save and whether to resume (the config's `checkpoint` section)."""

    section: ClassVar[str] = "checkpoint"

    every_steps: int = knob(10, "save every this many steps; 0 = only at the end")
    keep: int = knob(2, "checkpoints kept (older ones are deleted)")
    resume: bool = knob(True, "continue from the latest checkpoint in run_dir")

    def check(self) -> None:
        require(self.every_steps >= 0, f"{self.key('every_steps')}={self.every_steps} must be >= 0 (0 = only at the end).")
        require(self.keep >= 1, f"{self.key('keep')}={self.keep} must be at least 1.")
