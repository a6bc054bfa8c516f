"""Warm start for the code default: `python -m areal_jax.programs.sft --config=configs/sft_code.py`.

A small Qwen2-style decoder with a character-level tokenizer, trained from scratch on synthetic
programming tasks ("Write f(x) that returns the larger of x and 12." -> "def f(x):\\n    return
max(x,12)", hidden tests as asserts). Stage 1 learns correct programs until greedy test pass@1 passes
`stop_above`; stage 2 fine-tunes on a mix where most targets are the program of a look-alike task (min
for max, // for %) or a slipped constant, so the greedy policy is mostly wrong while it can still
sample correct programs: room for reinforcement learning with sandboxed test rewards.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.task = "code"
    c.out_dir = "assets/code_reasoner"
    c.seed = 0
    c.batch_size = 32
    c.seq_len = 136
    c.max_new_tokens = 56
    c.eval_n = 100
    c.eval_slots = 64

    c.data = ml_collections.ConfigDict()
    c.data.n_train = 1000
    c.data.n_test = 200
    c.data.seed = 0
    c.data.difficulty = "default"

    c.model = ml_collections.ConfigDict()
    c.model.architecture = "qwen2"
    c.model.hidden_size = 128
    c.model.intermediate_size = 384
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.max_position_embeddings = 256

    correct = ml_collections.ConfigDict(dict(
        name="correct", mix={"correct": 1.0}, lr=1e-3, warmup_steps=50, max_steps=360, max_minutes=240.0,
        eval_every=100, stop_above=0.8, stop_below=None))
    mix = ml_collections.ConfigDict(dict(
        name="mix", mix={"confused": 0.55, "correct": 0.3, "slip": 0.15}, lr=3e-4, warmup_steps=10,
        max_steps=60, max_minutes=20.0, eval_every=30, stop_above=None, stop_below=None))
    # assets/code_reasoner was made with stage 1 stopped by a 40-minute budget after 360 steps on a loaded
    # 2-core machine (greedy test pass@1 0.72); the step counts are pinned so the command is reproducible.
    c.stages = [correct, mix]
    return c
