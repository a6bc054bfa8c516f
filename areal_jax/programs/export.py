"""Write a run's policy as an HF directory (model + tokenizer) that transformers loads.

    python -m areal_jax.programs.export --run_dir=runs/math --out=runs/math/export [--step=N] [--format=merged|peft]

Reads the run's config.json, restores the latest (or the given) checkpoint onto this host's devices and
saves config.json, model.safetensors and the tokenizer files into --out. For a LoRA run, --format=merged
(the default) folds the adapters into the base; --format=peft writes the adapters alone in PEFT's layout
(adapter_config.json + adapter_model.safetensors, loaded with peft.PeftModel.from_pretrained on the base).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from areal_jax.config import JobConfig


def load_run_config(run_dir: str) -> JobConfig:
    """The config a run was started with (RUN_DIR/config.json) as a JobConfig; keys it lacks take
    today's defaults and keys no longer known are ignored (an older run still exports)."""
    from areal_jax import knobs, paths

    path = paths.join(run_dir, "config.json")  # a local, file:// or object-store run directory
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir!r} a run directory of areal_jax.main?")
    return knobs.from_mapping(JobConfig, json.loads(path.read_text()))


def restore_policy(run_dir: str, step: int | None = None) -> tuple[Any, JobConfig, int]:
    """The policy of checkpoint ``step`` (default: the latest) of ``run_dir`` on this host's first device:
    (model, the run's config, the step). A LoRA run's model carries its adapters (``models.lora.merged_model``
    folds them in). FileNotFoundError when the run holds no such checkpoint."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    from areal_jax.checkpoint import Checkpointer
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.trainer import Trainer
    from areal_jax.trainer.resume import restore_train_state

    config = load_run_config(run_dir)
    lora_cfg = config.lora if config.lora.enabled else None
    ckpt = Checkpointer(run_dir, keep=config.checkpoint.keep)
    try:
        steps = ckpt.all_steps()
        chosen = ckpt.latest_step() if step is None else int(step)
        if chosen is None:
            raise FileNotFoundError(f"{run_dir} holds no complete checkpoint.")
        if chosen not in steps:
            raise FileNotFoundError(f"{run_dir} holds no checkpoint of step {chosen}; it has steps {sorted(steps)}.")
        mesh = Mesh(np.array(jax.local_devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
        model = load_hf_checkpoint(config.model.path, mesh=mesh, param_dtype=config.model.storage_dtype,
                                   dtype=config.model.compute_dtype, max_len=config.rollout.max_len)
        if lora_cfg is not None:
            from areal_jax.models.lora import apply_lora

            apply_lora(model, lora_cfg, rngs=nnx.Rngs(config.seed))
        trainer = Trainer(model, config.train, mesh, schedule_steps=config.optimizer_steps,
                          wrt=nnx.Param if lora_cfg is None else nnx.LoRAParam)
        state, _, _ = restore_train_state(ckpt, chosen, trainer.state, trainer.cfg)
        trainer.state = state
        nnx.update(model, trainer.params)
    finally:
        ckpt.close()
    return model, config, chosen


def export_policy(run_dir: str, out_dir: str, step: int | None = None, fmt: str = "merged",
                  text_only: bool = False) -> str:
    """Restore checkpoint `step` (default: latest) of `run_dir` and save it as an HF directory.

    fmt "merged": the full model (a LoRA run's adapters folded into the base); "peft": a LoRA run's
    adapters alone as a PEFT directory (adapter_config.json + adapter_model.safetensors). A run that started from an
    image-and-text checkpoint (Gemma 3 4B and up, Mistral 3, Qwen3.5, Qwen3-VL, LFM2-VL, LFM3-VL) exports, merged, that checkpoint
    with its trained text decoder (`models.wrapped_export.rewrap`: the vision tower copied from it), or with
    `text_only` the decoder alone as a text model."""
    import jax

    from areal_jax.models import save_hf_checkpoint
    from areal_jax.tokenizer import Tokenizer

    if fmt not in ("merged", "peft"):
        raise ValueError(f"--format={fmt!r} is not one of merged, peft.")
    config = load_run_config(run_dir)
    lora_cfg = config.lora if config.lora.enabled else None
    if fmt == "peft" and lora_cfg is None:
        raise ValueError(f"--format=peft needs a LoRA run, but {run_dir} was run with lora.enabled=False; "
                         "export it with --format=merged.")
    model, config, _ = restore_policy(run_dir, step)
    if fmt == "peft":
        from areal_jax.models.peft_io import save_peft_adapter

        save_peft_adapter(model, lora_cfg, out_dir, base_model_name_or_path=os.path.abspath(config.model.path))
    else:
        if lora_cfg is not None:
            from areal_jax.models.lora import merged_model

            model = merged_model(model, lora_cfg.scale, config.model.storage_dtype)
        from areal_jax.models.wrapped_export import rewrap, wrapper_type
        from areal_jax.system.hf_export import MAX_SHARD_BYTES

        if text_only or not wrapper_type(config.model.path):
            save_hf_checkpoint(model, out_dir, max_shard_size=MAX_SHARD_BYTES)
        else:  # each decoder tensor fetched from the devices as it is written into the source's checkpoint
            rewrap(model, config.model.path, out_dir, MAX_SHARD_BYTES, writer=jax.process_index() == 0)
    Tokenizer.from_pretrained(config.model.tokenizer_path or config.model.path).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Export a run's policy as an HF directory.")
    parser.add_argument("--run_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--format", choices=("merged", "peft"), default="merged",
                        help="merged: full HF model (LoRA adapters folded in); peft: a LoRA run's adapters only")
    parser.add_argument("--text_only", action="store_true",
                        help="from an image-and-text checkpoint: the trained text decoder alone, as a text model "
                             "(default: the image-and-text checkpoint with its vision tower)")
    args = parser.parse_args(argv)
    print(export_policy(args.run_dir, args.out, args.step, args.format, args.text_only))


if __name__ == "__main__":
    main(sys.argv[1:])
