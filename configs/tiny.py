"""A tiny self-made run for smoke tests: `--config=configs/tiny.py:DIR` (assets are written into DIR).

A random 2-layer model with the synthetic-math tokenizer; a few seconds per step on a CPU.
"""
from areal_jax.system.tiny import tiny_config


def get_config(directory: str = "runs/tiny_assets"):
    return tiny_config(directory, run_dir=f"{directory}/run")
