"""A tiny self-made run for smoke tests: `--config=configs/tiny.py:DIR`.

Write the assets into DIR first (a random 2-layer model with the synthetic-math tokenizer, and
train / test problems): `python -m areal_jax.testing.tiny DIR`. A few seconds per step on a CPU.
"""
from areal_jax.testing.tiny import tiny_config


def get_config(directory: str = "runs/tiny_assets"):
    return tiny_config(directory, run_dir=f"{directory}/run", write=False)
