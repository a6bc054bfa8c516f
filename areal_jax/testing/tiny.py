"""A tiny, self-made run setup (random model + math tokenizer + synthetic problems) for tests and smoke runs.

`write_tiny_assets(dir)` writes an HF model directory with the synthetic-math tokenizer and train /
test JSONL splits; `tiny_config(dir)` returns a full run config over them that finishes in seconds.
Nothing is downloaded.
"""
from __future__ import annotations

import os

import jax.numpy as jnp

from areal_jax.config import base_config


def write_tiny_assets(directory: str, *, seed: int = 0, n_train: int = 200, n_test: int = 40) -> dict[str, str]:
    """Writes <dir>/model (HF dir incl. tokenizer) and <dir>/data/{train,test}.jsonl; returns the paths."""
    from areal_jax.data.math_tokenizer import build_math_tokenizer
    from areal_jax.data.synthetic_math import write_splits
    from areal_jax.testing.models import tiny_config as tiny_model_config
    from areal_jax.testing.models import write_random_hf_checkpoint

    tok = build_math_tokenizer()
    model_dir = os.path.join(directory, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        cfg = tiny_model_config("qwen2", vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id,
                                eos_token_id=tok.eos_token_id, dtype=jnp.float32)
        write_random_hf_checkpoint(model_dir, cfg, seed=seed)
        tok.save_pretrained(model_dir)
    paths = write_splits(os.path.join(directory, "data"), n_train, n_test, seed=seed)
    return {"model": model_dir, "train": paths["train"], "test": paths["test"]}


def length_parity_reward(completion: str, answer: str) -> float:
    """A reward a random model earns about half the time (odd-length completions), so GRPO groups have
    non-zero advantages and every tiny update really changes the params."""
    del answer
    return float(len(completion) % 2)


def tiny_paths(directory: str) -> dict[str, str]:
    """Where write_tiny_assets(directory) puts the model and the splits."""
    return {"model": os.path.join(directory, "model"), "train": os.path.join(directory, "data", "train.jsonl"),
            "test": os.path.join(directory, "data", "test.jsonl")}


def tiny_config(directory: str, *, run_dir: str | None = None, eta: int | None = 1, steps: int = 3,
                write: bool = True):
    """A complete run config over write_tiny_assets(directory): a few seconds per step on a CPU.

    write=False only points at the assets (config files must not touch JAX before
    jax.distributed.initialize; write them first with `python -m areal_jax.testing.tiny DIR`).
    """
    paths = write_tiny_assets(directory) if write else tiny_paths(directory)
    c = base_config()
    c.run_dir = run_dir or os.path.join(directory, "run")
    c.total_steps = steps
    c.model.path = paths["model"]
    c.data.train_path = paths["train"]
    c.data.test_path = paths["test"]
    c.data.max_prompt_len = 64
    c.rollout.group_size = 2
    c.rollout.max_new_tokens = 8
    c.rollout.max_len = 80
    c.rollout.num_slots = 8
    c.rollout.max_staleness = eta
    c.rollout.max_concurrent = 4 if eta is None else None
    c.train.batch_groups = 2
    c.train.lr = 1e-3
    c.train.micro_batch_tokens = 256
    c.reward.num_workers = 1
    c.reward.fn = "areal_jax.testing.tiny:length_parity_reward"
    c.eval.n_test = 0
    c.checkpoint.every_steps = 1
    c.log.console = False
    return c


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m areal_jax.testing.tiny DIR  (writes the tiny model and data into DIR)")
    print(write_tiny_assets(sys.argv[1]))
