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
"""
from areal_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/code_qwen"
    c.seed = 1
    c.total_steps = 400

    c.model.path = "/models/Qwen2.5-Coder-1.5B-Instruct"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"

    c.data.task = "code"
    c.data.train_path = "/data/taco/train.parquet"
    c.data.test_path = "/data/taco/test.parquet"
    c.data.question_field = "auto"  # each layout's statement field (question, problem, question_content, text, prompt)
    c.data.use_chat_template = True
    c.data.system_prompt = ("You are an expert Python programmer. Reason about the problem, then give the "
                            "complete solution in one ```python code block. Read from standard input and "
                            "write to standard output unless the task names a function to write.")
    c.data.max_prompt_len = 1536
    c.data.on_bad_row = "skip"  # public code sets hold some rows without usable tests

    c.mesh.train_fraction = 0.5
    c.mesh.tensor = 1
    c.mesh.rollout_tensor = -1

    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 2048
    c.rollout.max_len = 3584
    c.rollout.num_slots = 256
    c.rollout.temperature = 1.0
    c.rollout.max_staleness = 4
    c.rollout.on_update = "recompute"

    c.train.batch_groups = 64
    c.train.lr = 1e-6
    c.train.warmup_steps = 10
    c.train.loss = "decoupled"
    c.train.eps_clip = 0.2
    c.train.behav_weight_cap = 5.0
    c.train.micro_batch_tokens = 32768
    c.train.ppo_minibatches = 4

    c.reward.fn = "code"
    c.reward.code_mode = "all_pass"
    c.reward.code_case_timeout_s = 6.0
    c.reward.code_sample_timeout_s = 60.0
    c.reward.timeout_s = 90.0
    c.reward.num_workers = 16
    c.reward.memory_mb = 0  # each test run has its own address-space limit inside the sandbox

    c.eval.n_test = 500
    c.eval.max_new_tokens = 2048
    c.checkpoint.every_steps = 20
    return c
