"""Math and code in one run: a local Qwen2.5 instruct checkpoint on GSM8K and an APPS / TACO-layout code set, for
GPU / TPU hosts.

    python -m areal_jax.main --config=configs/math_code_qwen.py \
        --config.model.path=/models/Qwen2.5-1.5B-Instruct \
        --config.data.train_path=gsm8k=/data/gsm8k/train.jsonl,taco=/data/taco/train.parquet \
        --config.data.test_path=gsm8k=/data/gsm8k/test.jsonl,taco=/data/taco/test.parquet

Each file has its task (data.train_tasks / data.test_tasks, in the order of the files) and the stream draws from the
training files in the proportions of data.train_weights, each file shuffled and repeated on its own. reward.fn=mixed
scores a programming task's completions in the sandbox (the limits of configs/code_qwen.py) and every other row with
the math reward. Every step logs each file's reward and accuracy (source/<name>/...), every evaluation each set's
pass@1 (eval/<name>/...) beside the pooled figures. data.task_overrides gives the code files their own system prompt
and prompt budget.

It builds on configs/code_qwen.py (itself on configs/gsm8k_qwen.py) and changes what the mixture needs.
"""
import json

from areal_jax.config import load_config_file


def get_config():
    c = load_config_file("code_qwen.py", __file__)  # the GPU / TPU recipe and the sandbox's limits
    c.run_dir = "runs/math_code_qwen"

    c.model.path = "/models/Qwen2.5-1.5B-Instruct"

    c.data.task = "math"
    c.data.train_path = "gsm8k=/data/gsm8k/train.jsonl,taco=/data/taco/train.parquet"
    c.data.train_tasks = "math,code"
    c.data.train_weights = "1,1"
    c.data.test_path = "gsm8k=/data/gsm8k/test.jsonl,taco=/data/taco/test.parquet"
    c.data.test_tasks = "math,code"
    # Each task its own system prompt and prompt budget (data.task_overrides), as in configs/gsm8k_qwen.py and
    # configs/code_qwen.py.
    c.data.system_prompt = "Please reason step by step, and put your final answer within \\boxed{}."
    c.data.max_prompt_len = 512
    c.data.task_overrides = json.dumps({"code": {
        "system_prompt": ("You are an expert Python programmer. Reason about the problem, then give the complete "
                          "solution in one ```python code block. Read from standard input and write to standard "
                          "output unless the task names a function to write."),
        "max_prompt_len": 1536}})

    c.reward.fn = "mixed"
    c.eval.n_test = 500  # of each set
    return c
