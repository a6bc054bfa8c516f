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

With ``async_save`` (config key checkpoint.async_save, the default) `save()` returns once the state is copied
off the devices (on a CPU: once orbax holds a view of it, which makes the next update allocate fresh buffers
instead of donating these), and orbax writes it in a background thread while training goes on. One save is in
flight at most: the next save, `wait()`, `close()`, a restore or a listing of steps waits for it, and an error
of the write is raised there, naming the step. A kill during the write leaves the step unlisted, as above.
Saves and restores run inside areal_jax.orbax_compat's scoped workaround for two tensorstore leaks; an
asynchronous save keeps the scope open until its write is finished.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import Any, Callable, ClassVar

import jax
import orbax.checkpoint as ocp

from areal_jax import paths
from areal_jax.knobs import Section, knob, require
from areal_jax.orbax_compat import tensorstore_leak_workarounds


class StateMismatch(ValueError):
    """A checkpoint holds a train state of another structure than the one it is restored into."""


def _abstract(tree: Any) -> Any:
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


# A background save keeps the state it writes in host memory beside the state the updates go on with (on a CPU:
# the next update cannot donate the buffers being written), and tensorstore's write buffers come on top.
BACKGROUND_HOST_COPIES = 2.5


def available_host_bytes() -> int | None:
    """The host memory the kernel can still give (MemAvailable, Linux), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def local_state_bytes(state: Any) -> int:
    """Bytes of `state` this process writes: its addressable shards, each replicated shard once."""
    total = 0
    for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array):
            total += sum(s.data.nbytes for s in x.addressable_shards if s.replica_id == 0)
    return total


class CheckpointWriteError(RuntimeError):
    """An asynchronous checkpoint write failed (raised by the next save, wait, restore or close)."""


class Checkpointer:
    """Numbered checkpoints under `<run_dir>/checkpoints`, keeping the newest `keep`.

    Args:
      async_save: write the state in a background thread (see the module doc); False blocks in `save()`.
      on_written: called with (step, seconds from the start of `save()` until the step was complete) once a
        step is complete; from orbax's thread for an asynchronous save.
    """

    def __init__(self, run_dir: str, *, keep: int = 2, async_save: bool = False,
                 on_written: Callable[[int, float], None] | None = None, log: Callable[[str], None] = print):
        self.run_dir = paths.run_path(run_dir)
        self.directory = paths.checkpoint_directory(self.run_dir / "checkpoints")
        self.meta_root = self.run_dir / "checkpoint_meta"
        self.async_save = bool(async_save)
        self._on_written = on_written
        self._log = log
        self.blocking_fallbacks = 0  # background saves made blocking for want of host memory
        self._pending: int | None = None  # the step being written in the background
        self._t0 = 0.0
        self._scope = contextlib.ExitStack()  # the tensorstore workaround, open while a save is in flight
        self.last_blocked_s = 0.0  # how long the last save() held its caller
        self.last_write_s: float | None = None  # start of the last complete save to its completion
        # The barriers of a multi-process write wait up to timeout_secs: a large state on an object store is slow.
        async_options = (ocp.AsyncOptions(timeout_secs=3600, post_finalization_callback=self._written)
                         if self.async_save else None)
        self._mngr = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=self.async_save, async_options=async_options))

    def _written(self, step: int | None = None) -> None:
        step = self._pending if step is None else step
        self.last_write_s = time.perf_counter() - self._t0
        if self._on_written is not None and step is not None:
            self._on_written(step, self.last_write_s)

    def latest_step(self) -> int | None:
        """The newest complete step (after the save in flight, if any, is finished)."""
        self.wait()
        self._mngr.reload()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        self.wait()
        self._mngr.reload()
        return list(self._mngr.all_steps())

    def has_step(self, step: int) -> bool:
        """Whether `step` is saved or being saved (does not wait for a save of `step` itself)."""
        return step == self._pending or step in self.all_steps()

    @property
    def pending_step(self) -> int | None:
        return self._pending

    def _meta_path(self, step: int) -> Any:
        return self.meta_root / str(step) / f"process_{jax.process_index()}.json"

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write checkpoint `step`: the meta files now, the state now or in the background (``async_save``); the
        rename at the end of the state's write makes the step visible atomically."""
        t_call = time.perf_counter()
        self.wait()  # one save in flight at most; the last one's errors surface here
        t0 = time.perf_counter()
        path = self._meta_path(step)
        paths.makedirs(path.parent)
        write_json(path, meta)
        self._scope.enter_context(tensorstore_leak_workarounds())  # areal_jax/orbax_compat.py
        self._pending, self._t0 = step, t0
        blocking = not self.async_save or not self._host_room(step, state)
        try:
            self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)
        except BaseException:
            self._pending = None
            self._scope.close()
            raise
        if blocking:
            self.wait()
        self.last_blocked_s = time.perf_counter() - t_call

    def _host_room(self, step: int, state: Any) -> bool:
        """Whether the host has the memory a background save of `state` needs now; if not, this save blocks (the
        first time, a line says so)."""
        free, need = available_host_bytes(), BACKGROUND_HOST_COPIES * local_state_bytes(state)
        if free is None or need <= free:
            return True
        if not self.blocking_fallbacks:
            self._log(f"Checkpoint step {step} is written before training goes on, not in the background: the host "
                      f"has {free / 2**30:.1f} GiB of memory available and a background save of this "
                      f"{need / BACKGROUND_HOST_COPIES / 2**30:.1f} GiB state needs about {need / 2**30:.1f} GiB (a copy "
                      "kept until written). Later saves do the same while memory is short; "
                      "--config.checkpoint.async_save=False makes every save blocking.")
        self.blocking_fallbacks += 1
        return False

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise CheckpointWriteError if it failed."""
        step = self._pending
        if step is None:
            return
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            raise CheckpointWriteError(
                f"Checkpoint step {step} could not be written to {self.directory} ({type(e).__name__}: {e}). "
                "The previous complete step is still there to resume from; check the disk's space and "
                "permissions (or the object store's credentials).") from e
        finally:
            self._pending = None
            self._scope.close()
        if not self.async_save:
            self._written(step)
        self._prune_meta()

    def _prune_meta(self) -> None:
        """Remove this process's meta files of steps orbax no longer keeps (bounded disk use). Only steps older than
        the newest kept one: a newer step may be one another process is saving right now (its meta directory made,
        its file not yet written)."""
        steps = self.all_steps()
        kept = {str(s) for s in steps}
        for step_dir in self.meta_root.iterdir():
            name = step_dir.name
            if name in kept or not name.isdigit() or not steps or int(name) > max(steps):
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
        self.wait()
        path = self._meta_path(step)
        if not path.exists():
            raise FileNotFoundError(
                f"Checkpoint step {step} in {self.directory} has no metadata file {path}; it was not written "
                "by this code or the file was removed. Restore the file, or move that step away to resume "
                "from an earlier one."
            )
        meta = json.loads(path.read_text())
        try:
            with tensorstore_leak_workarounds():
                restored = self._mngr.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(like_state)))
                )
        except ValueError as err:
            if "structures do not match" not in str(err):
                raise
            detail = " ".join(str(err).split("\n")[1:4]).strip()
            raise StateMismatch(
                f"Checkpoint step {step} in {self.directory} holds a train state shaped otherwise than this run's "
                f"({detail}). The optimizer's state changes with train.max_grad_norm (None drops the clipping "
                "state), train.critic and lora.* (a run resumed by the job converts train.moment_dtype): resume "
                "with the settings the run was saved with, or start a new run directory.") from err
        return restored["state"], meta

    def close(self) -> None:
        """Wait for the save in flight, then release orbax's resources."""
        try:
            self.wait()
        finally:
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
    every_minutes: float = knob(0.0, "also save once this many minutes have passed since the last save, checked "
                                "after each step (for steps of minutes, or a preemptible machine); 0 = never. With "
                                "several processes, process 0's clock decides")
    resume: bool = knob(True, "continue from the latest checkpoint in run_dir")
    async_save: bool = knob(True, "write the train state in a background thread while training goes on: a save "
                            "holds the trainer only while the state is copied off the devices (it needs host memory "
                            "for a copy of the state until written; a save for which the host lacks it blocks, and "
                            "the job says so; areal_jax.checkpoint). False: the trainer waits for every write")
    hf_every_steps: int = knob(0, "also write the policy as an HF directory (config, safetensors, tokenizer; a LoRA "
                               "run's adapters merged) to RUN_DIR/hf/step_N every this many steps and after the "
                               "last, in a background thread, for evaluation with other tools; 0 = never")
    hf_keep: int = knob(0, "HF directories kept (the oldest deleted first); 0 = all")
    hf_dtype: str = knob("auto", "tensor dtype of the HF directories: auto (the model's storage dtype), bfloat16 "
                         "(half the bytes) or float32", choices=("auto", "bfloat16", "float32"))

    def check(self) -> None:
        require(self.every_steps >= 0, f"{self.key('every_steps')}={self.every_steps} must be >= 0 (0 = only at the end).")
        require(self.keep >= 1, f"{self.key('keep')}={self.keep} must be at least 1.")
        require(self.every_minutes >= 0, f"{self.key('every_minutes')}={self.every_minutes} must be >= 0 (0 = never).")
        require(self.hf_every_steps >= 0,
                f"{self.key('hf_every_steps')}={self.hf_every_steps} must be >= 0 (0 = never).")
        require(self.hf_keep >= 0, f"{self.key('hf_keep')}={self.hf_keep} must be >= 0 (0 = keep all).")
