"""Warm start for the embedded default: `python -m areal_jax.programs.sft --config=configs/sft_math.py`.

A 3.2M-parameter Qwen2-style decoder and a word-level tokenizer trained from scratch on synthetic
arithmetic word problems. Stage 1 learns worked solutions ("57+5=62. 62-6=56. #### 56") until greedy
test accuracy passes `stop_above`; stage 2 fine-tunes on a mix where most targets are the bare answer,
so the saved policy mostly answers without working (and is mostly wrong) while still able to sample
worked solutions: room for reinforcement learning to teach it to reason step by step.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.out_dir = "assets/math_reasoner"
    c.seed = 0
    c.batch_size = 32
    c.seq_len = 72
    c.max_new_tokens = 40
    c.eval_n = 300
    c.eval_slots = 64

    c.data = ml_collections.ConfigDict()
    c.data.n_train = 20000
    c.data.n_test = 1000
    c.data.seed = 0
    c.data.difficulty = "easy"

    c.model = ml_collections.ConfigDict()
    c.model.architecture = "qwen2"
    c.model.hidden_size = 256
    c.model.intermediate_size = 768
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.max_position_embeddings = 256

    worked = ml_collections.ConfigDict(dict(
        name="worked", mix={"worked": 1.0}, lr=1e-3, warmup_steps=100, max_steps=6000, max_minutes=120.0,
        eval_every=100, stop_above=0.75, stop_below=None))
    mix = ml_collections.ConfigDict(dict(
        name="mix", mix={"answer_only": 0.5, "worked": 0.35, "slip": 0.15}, lr=3e-4, warmup_steps=20,
        max_steps=100, max_minutes=120.0, eval_every=50, stop_above=None, stop_below=None))
    c.stages = [worked, mix]
    return c
