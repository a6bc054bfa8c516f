"""Save and resume everything a run needs to continue exactly, with orbax.

A checkpoint at step k holds:
- `state`: the trainer's TrainState (params, optimizer state, step, version), saved sharded (on many
  hosts every process writes its own shards; orbax coordinates);
- `meta` (JSON): version, the controller's pending prompts (admitted but not yet trained, in admission
  order), the prompt iterator's state, counters, the RNG seed and the config it ran with.
orbax writes each step into a temporary directory and renames it only when complete, so a checkpoint
cut short by a crash is never listed, let alone loaded: `latest_step()` only sees finished ones.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def _abstract(tree: Any) -> Any:
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


class Checkpointer:
    """Numbered checkpoints under `<run_dir>/checkpoints`, keeping the newest `keep`."""

    def __init__(self, run_dir: str, *, keep: int = 2):
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
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

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write checkpoint `step` (blocking; the rename at the end makes it visible atomically)."""
        self._mngr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._mngr.wait_until_finished()

    def restore(self, step: int, like_state: Any) -> tuple[Any, dict]:
        """Load checkpoint `step` into the structure, shapes and shardings of `like_state`."""
        restored = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(like_state)), meta=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], restored["meta"]

    def close(self) -> None:
        self._mngr.close()


def example_to_json(example: Any) -> dict:
    """A PromptExample (dataclass) as a JSON-serialisable dict."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(example).items()}


def write_json(path: str, obj: Any) -> None:
    """Write JSON atomically (temp file + rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)
