"""The policy as HF directories during a run (`checkpoint.hf_every_steps`).

RUN_DIR/hf/step_N holds config.json, the safetensors file(s) and the tokenizer files: transformers (and the
tools built on it: vLLM, lm-eval) load it while training goes on. A LoRA run's adapters are merged into the base. A
run from an image-and-text checkpoint exports that checkpoint with its trained text decoder (`wrapped_export`).

The trainer's thread only copies the weights to the host (`models.hf_io.host_checkpoint`; every process takes
part in gathering sharded arrays, process 0 writes). A background thread writes the files into a hidden
directory (`.step_N.partial`) and renames it, so a directory named step_N is always complete. One export is in
flight at a time: the next one, and the run's end, wait for it. When the host lacks the memory for that copy, the
trainer's thread writes the directory itself, one shard in memory at a time, and the job says so. On an object
store the directory is written node-locally, then uploaded file by file. A failed write costs that export only:
it is logged, and the train-state checkpoints do not depend on it.
"""
from __future__ import annotations

import os
import re
import shutil
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax import paths
from areal_jax.checkpoint import CheckpointConfig, available_host_bytes
from areal_jax.models.hf_io import host_checkpoint, save_hf_checkpoint
from areal_jax.models.wrapped_export import rewrap, wrapper_type

MAX_SHARD_BYTES = 5 * 2**30  # safetensors files of at most 5 GiB, as the hub's checkpoints
_STEP_DIR = re.compile(r"step_(\d+)")


class HFExporter:
    """Writes RUN_DIR/hf/step_N directories; `due(step)` says when, `export(model, step)` writes one."""

    def __init__(self, run_dir: paths.PathLike, tokenizer: Any, config: CheckpointConfig, *,
                 lora_scale: float | None = None, log: Callable[[str], None] = print, memory_margin: float = 1.5,
                 source: str | None = None):
        """config: the job's `checkpoint` section (hf_every_steps, hf_keep, hf_dtype); tokenizer: what is saved
        beside the weights (`save_pretrained`); lora_scale: a LoRA run's alpha / rank (its adapters are merged);
        memory_margin: host memory needed for a background export, in copies of the weights; source: the checkpoint
        the run started from: an image-and-text one is exported whole, its trained decoder written back into it
        (`models.wrapped_export.rewrap`)."""
        self.every, self.keep, self.log = config.hf_every_steps, config.hf_keep, log
        self.dtype = None if config.hf_dtype == "auto" else jnp.dtype(config.hf_dtype)
        self.tokenizer, self.lora_scale, self.memory_margin = tokenizer, lora_scale, memory_margin
        self.source = source if source and wrapper_type(source) else None
        self.primary = jax.process_index() == 0
        self.root = paths.join(run_dir, "hf")
        self._dir = paths.MirroredDir(self.root) if self.primary and self.every else None
        self._thread: threading.Thread | None = None
        self.written: list[int] = []  # steps whose directory is complete (process 0)
        self.last_step: int | None = None  # the last step exported (every process)
        self.failures = 0
        self.held_s = 0.0  # the trainer's thread, copying weights (and writing, when memory was short)
        self.write_s = 0.0  # writing, wherever it ran
        self.blocking = 0  # exports written by the trainer's thread for lack of host memory

    def due(self, step: int, final: bool = False) -> bool:
        """Whether step `step` is exported: every `every_steps`-th, and the last (`final`) unless it just was."""
        if self.every <= 0 or step <= 0 or step == self.last_step:
            return False
        return final or step % self.every == 0

    def maybe_export(self, policy: Callable[[], nnx.Module], step: int, final: bool = False) -> None:
        """`export(policy(), step)` when `due(step, final)`."""
        if self.due(step, final):
            self.export(policy(), step)

    def export(self, model: nnx.Module, step: int) -> None:
        """Writes `model` (the current policy; LoRA adapters applied) as hf/step_`step`. Every process calls it."""
        self.wait()
        self.last_step = step
        start = time.perf_counter()
        if self.lora_scale is not None:
            from areal_jax.models.lora import merged_model

            model = merged_model(model, self.lora_scale, model.cfg.param_dtype)
        itemsize = jnp.dtype(self.dtype or model.cfg.param_dtype).itemsize
        need = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) * itemsize
        free = available_host_bytes()
        if free is not None and free < self.memory_margin * need:
            self.blocking += 1
            if self.primary:
                self.log(f"HF export of step {step}: the host has {free / 2**30:.1f} GiB available, a background "
                         f"copy of the weights needs {need / 2**30:.1f} GiB; writing while the trainer waits.")
            if self.source is None:
                self._write(step, lambda path: save_hf_checkpoint(model, path, max_shard_size=MAX_SHARD_BYTES,
                                                                  dtype=self.dtype))
            else:  # the image-and-text checkpoint, each decoder tensor fetched as it is written
                self._write(step, lambda path: rewrap(model, self.source, path, MAX_SHARD_BYTES, dtype=self.dtype,
                                                      writer=self.primary))
            self.held_s += time.perf_counter() - start
            return
        snapshot = host_checkpoint(model, self.dtype)  # what later updates do not change
        self.held_s += time.perf_counter() - start
        if not self.primary:
            return
        def write(path: str) -> None:  # the whole directory: an image-and-text one straight from the snapshot
            if self.source is None:
                snapshot.write(path, MAX_SHARD_BYTES)
            else:
                rewrap(dict(zip(snapshot.names, snapshot.tensors)), self.source, path, MAX_SHARD_BYTES)

        self._thread = threading.Thread(target=self._write, name=f"hf-export-{step}", daemon=True,
                                        args=(step, write))
        self._thread.start()

    def _write(self, step: int, write_weights: Callable[[str], None]) -> None:
        """Writes hf/step_`step` with `write_weights(directory)` (its weights and config.json), then the tokenizer."""
        start = time.perf_counter()
        if not self.primary:
            write_weights(os.devnull)  # the gathers need every process; only process 0 writes files
            return
        partial = os.path.join(self._dir.local, f".step_{step}.partial")
        final = os.path.join(self._dir.local, f"step_{step}")
        try:
            shutil.rmtree(partial, ignore_errors=True)
            write_weights(partial)
            self.tokenizer.save_pretrained(partial)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            if self._dir.remote:
                self._dir.sync()
                shutil.rmtree(final, ignore_errors=True)
            self.written.append(step)
            self._prune()
            seconds = time.perf_counter() - start
            self.write_s += seconds
            mib = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(final) for f in fs) / 2**20 \
                if os.path.isdir(final) else float("nan")
            self.log(f"HF export of step {step}: {paths.join(self.root, f'step_{step}')} "
                     f"({'' if np.isnan(mib) else f'{mib:.0f} MiB, '}{seconds:.1f} s).")
        except Exception as err:  # noqa: BLE001 - one export lost, not the run
            shutil.rmtree(partial, ignore_errors=True)
            self.failures += 1
            self.log(f"HF export of step {step} failed ({type(err).__name__}: {err}); training goes on, and the "
                     "train-state checkpoints do not depend on it.")

    def _steps_on_disk(self) -> list[int]:
        root = self.root
        if not root.exists():
            return []
        return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)))

    def _prune(self) -> None:
        if not self.keep:
            return
        steps = self._steps_on_disk()
        for step in steps[: max(0, len(steps) - self.keep)]:
            old = self.root / f"step_{step}"
            if paths.is_local(old):
                shutil.rmtree(os.fspath(old), ignore_errors=True)
            else:
                old.rmtree()

    def wait(self) -> None:
        """Returns once the export in flight (if any) is written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.wait()
        if self._dir is not None and self._dir.remote:
            self._dir.close()
