"""The embedded code default: `python -m areal_jax.main --config=configs/code.py`.

A small character-level code model (assets/code_reasoner, made by
`python -m areal_jax.programs.sft --config=configs/sft_code.py`) learns by asynchronous GRPO with the decoupled
PPO objective (eta = 4) on synthetic programming tasks ("Write f(x) that returns the larger of x and
12."). Each completion is a program; its reward is 1 when it passes every hidden assert test, run in the
sandbox by the reward pool (rewards/code.py). Ends with a before / after table of held-out pass@1.
"""
from areal_jax.config import base_config

ASSETS = "assets/code_reasoner"


def get_config():
    c = base_config()
    c.run_dir = "runs/code"
    c.seed = 0
    c.total_steps = 30

    c.model.path = ASSETS
    c.data.task = "code"
    c.data.train_path = f"{ASSETS}/data/train.jsonl"
    c.data.test_path = f"{ASSETS}/data/test.jsonl"
    c.data.question_field = "text"
    c.data.max_prompt_len = 88

    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 56
    c.rollout.max_len = 144
    c.rollout.num_slots = 64
    c.rollout.temperature = 1.0
    c.rollout.max_staleness = 4
    c.rollout.on_update = "recompute"

    c.train.batch_groups = 8
    c.train.lr = 1e-4
    c.train.loss = "decoupled"
    c.train.eps_clip = 0.2
    c.train.behav_weight_cap = 5.0
    c.train.micro_batch_tokens = 2048
    c.train.max_grad_norm = 1.0

    c.reward.fn = "code"
    c.reward.code_mode = "all_pass"
    c.reward.code_case_timeout_s = 2.0
    c.reward.code_sample_timeout_s = 8.0
    c.reward.timeout_s = 15.0
    c.reward.num_workers = 2
    c.reward.memory_mb = 0  # each test run has its own address-space limit inside the sandbox

    c.eval.n_test = 200
    c.eval.max_new_tokens = 56
    c.checkpoint.every_steps = 20
    return c
