"""Supervised warm start: a small model of our family and its tokenizer, trained from scratch (or continued from an
earlier warm start, ``init_from``).

    python -m areal_jax.programs.sft --config=configs/sft_math.py
    python -m areal_jax.programs.sft --config=configs/sft_code.py     # task "code": synthetic programming tasks
    python -m areal_jax.programs.sft --config=configs/sft_code_repair.py  # continues sft_code's on repair turns

Stages run in order, each on its own mix of target styles (synthetic_math.format_target): typically
worked solutions until the model can do the arithmetic, then a mix where most targets give the bare
answer ("#### 56", which the model cannot compute without steps) so the saved policy rarely reasons
step by step when greedy, yet can sample such solutions: the headroom reinforcement learning needs.
A stage ends at its step budget, its time budget, or when greedy test accuracy crosses its stop
threshold. The code task's "repair" style trains two-attempt rows laid out as a rollout's repair turn
(a wrong program, its execution feedback, the correct program; the loss on the repair), and the final evaluation
then also scores one repair turn. The result is an HF directory (config.json, model.safetensors, tokenizer files) plus the
train / test JSONL splits it was trained and measured on.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app
from flax import nnx
from ml_collections import ConfigDict, config_flags

from areal_jax.knobs import ConfigError
from areal_jax.programs.sft_config import SFTConfig, from_config_dict

_CONFIG = None  # the --config flag, defined only when this module runs as the program (see the bottom)


def encode_example(tokenizer: Any, prompt_ids: list[int], target: str) -> tuple[np.ndarray, np.ndarray]:
    """prompt + " " + target + <eos> as ids, and a loss mask that is 1 on target tokens (incl. eos)."""
    target_ids = tokenizer.encode(" " + target) + [tokenizer.eos_token_id]
    ids = np.asarray(prompt_ids + target_ids, np.int32)
    mask = np.concatenate([np.zeros(len(prompt_ids)), np.ones(len(target_ids))]).astype(np.float32)
    return ids, mask


def encode_repair_example(tokenizer: Any, prompt_ids: list[int], first: str, feedback: str, repair: str,
                          template: str) -> tuple[np.ndarray, np.ndarray]:
    """A two-attempt row laid out as a rollout's repair turn is: prompt, " " + first + <eos>, the template around
    the feedback, " " + repair + <eos>. The loss mask is 1 on the repair only (the wrong first attempt and the
    feedback are context)."""
    eos = tokenizer.eos_token_id
    context = tokenizer.encode(" " + first) + [eos] + tokenizer.encode(template.format(feedback=feedback))
    target = tokenizer.encode(" " + repair) + [eos]
    ids = np.asarray(prompt_ids + context + target, np.int32)
    mask = np.concatenate([np.zeros(len(prompt_ids) + len(context)), np.ones(len(target))]).astype(np.float32)
    return ids, mask


def make_batch(rows: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded tokens [B, seq_len] int32 and next-token targets / mask [B, seq_len]."""
    b = len(rows)
    tokens = np.full((b, seq_len), pad_id, np.int32)
    targets = np.full((b, seq_len), pad_id, np.int32)
    mask = np.zeros((b, seq_len), np.float32)
    for i, (ids, m) in enumerate(rows):
        n = min(len(ids), seq_len)
        tokens[i, :n] = ids[:n]
        targets[i, : n - 1] = ids[1:n]
        mask[i, : n - 1] = m[1:n]  # predict token t+1 at position t
    return {"tokens": tokens, "targets": targets, "mask": mask}


def new_model_config(m: Any, tokenizer: Any) -> Any:
    """The ModelConfig of a new model from the config's model section and the task's tokenizer."""
    from areal_jax.models import ModelConfig

    return ModelConfig(
        architecture=m.architecture, vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.hidden_size // m.num_heads, rope_theta=10000.0,
        rms_norm_eps=1e-6, max_position_embeddings=m.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True, attention_bias=m.architecture == "qwen2", qk_norm=m.architecture == "qwen3",
    )


def make_train_step(graphdef: Any, tx: optax.GradientTransformation):
    """A jitted (params, opt_state, batch) -> (params, opt_state, loss) cross-entropy step."""

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["tokens"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.sum(nll * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def sample_styles(rng: random.Random, mix: dict[str, float], n: int) -> list[str]:
    names, weights = zip(*sorted(mix.items()))
    return rng.choices(names, weights=weights, k=n)


def run(config: ConfigDict | SFTConfig) -> dict:
    """Train the stages of `config` (a config file's ConfigDict, converted once here, or an SFTConfig) and
    save the model; returns the summary also written to <out_dir>/sft_summary.json."""
    from areal_jax.data import load_eval_split
    from areal_jax.data.prompts import PromptFormat
    from areal_jax.evaluation.scoring import evaluate_examples
    from areal_jax.models import Transformer, save_hf_checkpoint

    c = from_config_dict(config)
    # The synthetic task: "math" (word problems, math reward) or "code" (programming tasks, sandboxed tests).
    if c.task == "code":
        from areal_jax.data import code_synthetic as synthetic
        from areal_jax.data.code_readers import CODE_TASK_OPTIONS as load_options

        reward_fn, build_tokenizer = synthetic.REWARD_FN, synthetic.build_tokenizer
    else:
        from areal_jax.data import synthetic_math as synthetic
        from areal_jax.data.math_tokenizer import build_math_tokenizer as build_tokenizer

        reward_fn, load_options = "areal_jax.rewards.math:math_reward", {}
    format_target, generate_split = synthetic.format_target, synthetic.generate_split

    os.makedirs(c.out_dir, exist_ok=True)
    data_dir = os.path.join(c.out_dir, "data")
    synthetic.write_splits(data_dir, c.data.n_train, c.data.n_test, seed=c.data.seed, difficulty=c.data.difficulty)
    train = generate_split("train", c.data.n_train, c.data.seed, c.data.difficulty)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(c.out_dir)
    test = load_eval_split(os.path.join(data_dir, "test.jsonl"), tokenizer, **load_options)[: c.eval_n]
    fmt = PromptFormat()
    prompt_ids = fmt.encode_many(tokenizer, [p.question for p in train])

    m = c.model
    if c.init_from:
        from areal_jax.models import load_hf_checkpoint

        model = load_hf_checkpoint(c.init_from)
        if model.cfg.vocab_size != tokenizer.vocab_size:
            raise ConfigError(f"--config.init_from={c.init_from!r} has a vocabulary of {model.cfg.vocab_size}, "
                              f"not the {c.task} task's {tokenizer.vocab_size}.")
        if c.seq_len > model.cfg.max_position_embeddings:
            raise ConfigError(f"--config.seq_len={c.seq_len} exceeds the max_position_embeddings="
                              f"{model.cfg.max_position_embeddings} of --config.init_from={c.init_from!r}.")
    else:
        model = Transformer(new_model_config(m, tokenizer), rngs=nnx.Rngs(c.seed))
    graphdef, params = nnx.split(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    start = f" from {c.init_from}" if c.init_from else ""
    print(f"model{start}: {n_params / 1e6:.2f}M params, vocab {model.cfg.vocab_size}; {len(train)} train problems",
          flush=True)
    repair = None  # the "repair" style: rows of two attempts, and a final evaluation with a repair turn
    if any(stage.mix.get("repair", 0) > 0 for stage in c.stages):
        import functools

        from areal_jax.rewards.code_feedback import code_feedback
        from areal_jax.sampler.turns import FeedbackTurns

        repair = functools.partial(FeedbackTurns, turns=1, template=synthetic.REPAIR_TEMPLATE, encode=tokenizer.encode,
                                   decode=tokenizer.decode, feedback=functools.partial(code_feedback, cases=1))

    def example(i: int, style: str, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        if style == "repair":
            parts = synthetic.repair_target(train[i], rng)
            if parts is not None:
                return encode_repair_example(tokenizer, prompt_ids[i], *parts, template=synthetic.REPAIR_TEMPLATE)
            style = "correct"  # the wrong program passed the shown test: no repair turn would follow it
        return encode_example(tokenizer, prompt_ids[i], format_target(train[i], style, rng))

    rng = random.Random(c.seed)
    log = []
    t_start = time.perf_counter()
    for stage in c.stages:
        sched = optax.warmup_constant_schedule(0.0, stage.lr, max(1, stage.warmup_steps))
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
        opt_state = tx.init(params)
        step_fn = make_train_step(graphdef, tx)
        t_stage, acc = time.perf_counter(), None
        for step in range(1, stage.max_steps + 1):
            idx = [rng.randrange(len(train)) for _ in range(c.batch_size)]
            styles = sample_styles(rng, dict(stage.mix), len(idx))
            rows = [example(i, s, rng) for i, s in zip(idx, styles)]
            params, opt_state, loss = step_fn(params, opt_state, make_batch(rows, c.seq_len, tokenizer.pad_token_id))
            minutes = (time.perf_counter() - t_stage) / 60
            last = step == stage.max_steps or minutes >= stage.max_minutes
            if step % stage.eval_every == 0 or last:
                res = evaluate_examples(nnx.merge(graphdef, params), tokenizer, test, max_new_tokens=c.max_new_tokens,
                                        k=0, num_slots=c.eval_slots, reward_fn=reward_fn)
                acc = res["greedy_pass@1"]
                entry = {"stage": stage.name, "step": step, "loss": float(loss), "greedy_pass@1": acc,
                         "minutes": (time.perf_counter() - t_start) / 60}
                log.append(entry)
                print(json.dumps(entry), flush=True)
                if stage.stop_above is not None and acc >= stage.stop_above:
                    break
                if stage.stop_below is not None and acc <= stage.stop_below:
                    break
            if last:
                break
    model = nnx.merge(graphdef, params)
    final = evaluate_examples(model, tokenizer, test, max_new_tokens=c.max_new_tokens, k=8, num_slots=c.eval_slots,
                              reward_fn=reward_fn, repair=repair)
    save_hf_checkpoint(model, c.out_dir)
    tokenizer.save_pretrained(c.out_dir)
    summary = {"params": int(n_params), "stages": log,
               "final": {k: v for k, v in final.items() if k != "sample_greedy"},
               "minutes": (time.perf_counter() - t_start) / 60}
    with open(os.path.join(c.out_dir, "sft_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["final"]), flush=True)
    return summary


def main(argv: list[str]) -> None:
    del argv
    from areal_jax.programs.rl import quiet_library_logs

    quiet_library_logs()
    try:
        run(_CONFIG.value)
    except ConfigError as e:
        print(f"Config error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/sft_math.py", "SFT config file.")
    app.run(main)
