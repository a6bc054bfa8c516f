"""`python -m areal_jax.main --config=configs/math.py [--config.KEY=VALUE ...]`: the asynchronous RL job.

The program itself is areal_jax.programs.rl (`run(config)` runs a validated config in-process); the
other programs (sft, evaluate, export, report) live beside it in areal_jax.programs.
"""
from areal_jax.programs.rl import cli

if __name__ == "__main__":
    cli()
