"""Code RL with a local Qwen2.5-Coder instruct checkpoint on an APPS / TACO-layout dataset, for GPU / TPU hosts.

    python -m areal_jax.main --config=configs/code_qwen.py \
        --config.model.path=/models/Qwen2.5-Coder-1.5B-Instruct \
        --config.data.train_path=/data/taco/train.parquet --config.data.test_path=/data/taco/test.parquet

Nothing is downloaded: point model.path at an HF directory (config.json, *.safetensors, tokenizer.json,
tokenizer_config.json) and the data paths at JSONL or Parquet files in one of the layouts
data/code_readers.py reads: APPS / TACO rows ("question" plus "input_output" with inputs, outputs and
optionally fn_name), DeepCoder rows ("problem" / "tests" / "metadata"), LiveCodeBench rows
("question_content" / "public_test_cases"), CodeContests rows ("description" / "public_tests" / "private_tests"),
Codeforces rows (open-r1/codeforces: "official_tests", judged by the row's "generated_checker" where the problem
accepts many outputs), MBPP rows ("text" / "test_list") or HumanEval rows ("prompt" / "test" / "entry_point"); a
file may mix them. The hidden tests never reach the prompt; each completion's last ```python block runs
against them in the sandbox (rewards/code.py), reward 1 when every case passes
(`--config.reward.code_mode=pass_rate` for the fraction). Rows without usable tests are skipped and
counted. Sandboxed tests run in `reward.num_workers` processes: size it to the host's spare CPU cores
(benchmarks/sandbox.py measures what one core sustains).

Repair turns (README, "Repair turns"): `--config.rollout.feedback_turns=1 --config.rollout.feedback_template=chat`
shows the feedback as a user turn in the model's own chat frame (for Qwen
'\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n', read off the tokenizer's chat template; the
first attempt already ends with <|im_end|>), with a larger rollout.max_new_tokens / max_len.

It builds on configs/gsm8k_qwen.py (the same mesh split, rollout and GRPO update) and changes what code needs.
"""
from areal_jax.config import load_config_file


def get_config():
    c = load_config_file("gsm8k_qwen.py", __file__)  # the same GPU / TPU recipe (mesh, rollout, GRPO update), on code
    c.run_dir = "runs/code_qwen"

    c.model.path = "/models/Qwen2.5-Coder-1.5B-Instruct"

    c.data.task = "code"
    c.data.train_path = "/data/taco/train.parquet"
    c.data.test_path = "/data/taco/test.parquet"
    c.data.question_field = "auto"  # each layout's statement field (question, problem, question_content, text, prompt)
    c.data.system_prompt = ("You are an expert Python programmer. Reason about the problem, then give the "
                            "complete solution in one ```python code block. Read from standard input and "
                            "write to standard output unless the task names a function to write.")
    c.data.max_prompt_len = 1536
    c.data.on_bad_row = "skip"  # public code sets hold some rows without usable tests

    c.rollout.max_new_tokens = 2048
    c.rollout.max_len = 3584
    c.train.micro_batch_tokens = 32768

    c.reward.fn = "code"
    c.reward.code_mode = "all_pass"
    c.reward.code_case_timeout_s = 6.0
    c.reward.code_sample_timeout_s = 60.0
    c.reward.timeout_s = 90.0
    c.reward.num_workers = 16
    c.reward.memory_mb = 0  # each test run has its own address-space limit inside the sandbox

    c.eval.n_test = 500
    c.eval.max_new_tokens = 2048
    return c
