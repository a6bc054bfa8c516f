"""The programs: each module is run as `python -m areal_jax.programs.<name>` (the RL job also as
`python -m areal_jax.main`).

  rl        asynchronous RL (rollout and training at the same time); `run(config)` in-process
  sft       supervised fine-tuning, e.g. the warm start of the default job
  evaluate  greedy / sampled pass@1 and pass@k of an HF directory on a split
  export    a run's checkpoint as an HF directory (merged) or PEFT adapters
  report    curves.png and report.md of a run directory
"""
