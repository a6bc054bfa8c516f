"""GSM8K with a local Qwen2.5 instruct checkpoint, for GPU / TPU hosts.

    python -m areal_jax.main --config=configs/gsm8k_qwen.py \
        --config.model.path=/models/Qwen2.5-1.5B-Instruct \
        --config.data.train_path=/data/gsm8k/train.jsonl --config.data.test_path=/data/gsm8k/test.jsonl

Nothing is downloaded: point model.path at an HF directory (config.json, *.safetensors, tokenizer.json,
tokenizer_config.json) and the data paths at GSM8K in its JSONL layout ("question" / "answer" with the
final answer after "####"). On an 8-GPU host the default split gives 4 devices to training (FSDP) and 4
to generation, as 4 sampler replicas of one device each (mesh.rollout_tensor=1; a 1.5B model fits one device, and its
2 kv heads would not split over 4 tensor devices anyway); across nodes use launchers/slurm.sbatch or
launchers/tpu_pod.sh. For a model that does not fit one device, raise mesh.rollout_tensor (-1: one sampler over every
rollout device).
"""
from areal_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/gsm8k_qwen"
    c.seed = 1
    c.total_steps = 400

    c.model.path = "/models/Qwen2.5-1.5B-Instruct"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"

    c.data.train_path = "/data/gsm8k/train.jsonl"
    c.data.test_path = "/data/gsm8k/test.jsonl"
    c.data.use_chat_template = True
    c.data.system_prompt = "Please reason step by step, and put your final answer within \\boxed{}."
    c.data.max_prompt_len = 512

    c.mesh.train_fraction = 0.5
    c.mesh.tensor = 1
    c.mesh.rollout_tensor = 1  # data-parallel samplers (sampler.replicas), each with rollout.num_slots slots

    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 1024
    c.rollout.max_len = 1536
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
    c.train.micro_batch_tokens = 16384
    c.train.ppo_minibatches = 4

    c.reward.fn = "math"
    c.reward.num_workers = 8
    c.reward.timeout_s = 10.0

    c.eval.n_test = 1319
    c.eval.max_new_tokens = 1024
    c.checkpoint.every_steps = 20
    return c
