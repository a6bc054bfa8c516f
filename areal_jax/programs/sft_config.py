"""The typed config of the supervised warm start (programs/sft.py): sections built with areal_jax.knobs.

Config files (configs/sft_math.py, configs/sft_code.py) stay ml_collections ConfigDicts; `from_config_dict`
converts one once, at start-up, raising a one-sentence ConfigError on an unknown key, a wrong type or a
value out of range.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, ClassVar

from areal_jax import knobs
from areal_jax.knobs import ConfigError, Section, knob, require
from areal_jax.models.config import ARCHITECTURES


@dataclasses.dataclass(frozen=True)
class SFTDataConfig(Section):
    """The synthetic task's splits."""

    section: ClassVar[str] = "data"

    n_train: int = knob(20000, "training problems generated")
    n_test: int = knob(1000, "test problems generated (written to <out_dir>/data/test.jsonl)")
    seed: int = knob(0, "seed of the generated problems")
    difficulty: str = knob("easy", "the generator's difficulty preset (math: easy | medium | hard; code: "
                           "default)")

    def check(self) -> None:
        require(self.n_train >= 1 and self.n_test >= 1,
                f"{self.key('n_train')}={self.n_train} and {self.key('n_test')}={self.n_test} must be at least 1.")


@dataclasses.dataclass(frozen=True)
class SFTModelConfig(Section):
    """Shape of the decoder trained from scratch (vocabulary from the task's tokenizer)."""

    section: ClassVar[str] = "model"

    architecture: str = knob("qwen2", "decoder family", choices=ARCHITECTURES)
    hidden_size: int = knob(256, "model width")
    intermediate_size: int = knob(768, "MLP width")
    num_layers: int = knob(4, "decoder layers")
    num_heads: int = knob(4, "query heads (head_dim = hidden_size / num_heads)")
    num_kv_heads: int = knob(2, "key / value heads (grouped-query attention)")
    max_position_embeddings: int = knob(256, "longest position the rotary table covers")

    def check(self) -> None:
        k = self.key
        require(min(self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads, self.num_kv_heads) >= 1,
                f"{k('hidden_size')}, intermediate_size, num_layers, num_heads and num_kv_heads must be at least 1.")
        require(self.hidden_size % self.num_heads == 0,
                f"{k('hidden_size')}={self.hidden_size} is not divisible by {k('num_heads')}={self.num_heads}.")
        require(self.num_heads % self.num_kv_heads == 0,
                f"{k('num_heads')}={self.num_heads} is not divisible by {k('num_kv_heads')}={self.num_kv_heads}.")


@dataclasses.dataclass(frozen=True)
class StageConfig(Section):
    """One stage of training: a mix of target styles, an optimizer and when to stop."""

    section: ClassVar[str] = "stages[]"

    name: str = knob("stage", "shown in the log")
    mix: dict[str, float] = knob({"worked": 1.0}, "target style -> sampling weight (the task's format_target styles)")
    lr: float = knob(1e-3, "AdamW learning rate after warm-up")
    warmup_steps: int = knob(100, "linear warm-up steps from 0")
    max_steps: int = knob(1000, "step budget")
    max_minutes: float = knob(120.0, "time budget")
    eval_every: int = knob(100, "greedy test evaluation every this many steps (and at the end)")
    stop_above: float | None = knob(None, "stop once greedy test pass@1 reaches this (None: never)")
    stop_below: float | None = knob(None, "stop once greedy test pass@1 falls to this (None: never)")

    def check(self) -> None:
        k = self.key
        require(bool(self.mix) and all(w >= 0 for w in self.mix.values()) and sum(self.mix.values()) > 0,
                f"{k('mix')}={self.mix!r} needs at least one style with a positive weight.")
        require(self.lr > 0, f"{k('lr')}={self.lr} must be positive.")
        require(self.max_steps >= 1 and self.eval_every >= 1,
                f"{k('max_steps')}={self.max_steps} and {k('eval_every')}={self.eval_every} must be at least 1.")
        require(self.warmup_steps >= 0 and self.max_minutes > 0,
                f"{k('warmup_steps')}={self.warmup_steps} must be >= 0 and {k('max_minutes')}={self.max_minutes} "
                "positive.")


@dataclasses.dataclass(frozen=True)
class SFTConfig(Section):
    """A warm-start run: task, batch shape, evaluation, and the stages in order."""

    section: ClassVar[str] = ""

    task: str = knob("math", "synthetic task: math (word problems) | code (programming tasks with hidden tests)",
                     choices=("math", "code"))
    out_dir: str = knob("assets/math_reasoner", "HF directory written (model, tokenizer, data splits, summary)")
    seed: int = knob(0, "initialisation and batch order")
    init_from: str = knob("", "an HF directory of the task's tokenizer to continue from (e.g. an earlier warm start); "
                              "empty: a new model as the model section says")
    batch_size: int = knob(32, "sequences per step")
    seq_len: int = knob(72, "tokens per sequence (prompt + target, right-padded or cut)")
    max_new_tokens: int = knob(40, "completion tokens at most when evaluating")
    eval_n: int = knob(300, "test problems evaluated")
    eval_slots: int = knob(64, "decode slots of the evaluation's sampler")
    data: SFTDataConfig = dataclasses.field(default_factory=SFTDataConfig)
    model: SFTModelConfig = dataclasses.field(default_factory=SFTModelConfig)
    stages: tuple[StageConfig, ...] = knob((StageConfig(),), "the stages, run in order")

    def check(self) -> None:
        require(bool(self.stages), "--config.stages is empty: give at least one stage.")
        require(min(self.batch_size, self.seq_len, self.max_new_tokens, self.eval_n, self.eval_slots) >= 1,
                "--config.batch_size, seq_len, max_new_tokens, eval_n and eval_slots must be at least 1.")
        styles = task_styles(self.task)
        for i, stage in enumerate(self.stages):
            unknown = sorted(set(stage.mix) - set(styles))
            require(not unknown, f"--config.stages[{i}].mix names {unknown}, not target styles of task "
                                 f"{self.task!r}: use {list(styles)}.")
        require(not self.init_from or os.path.isfile(os.path.join(self.init_from, "config.json")),
                f"--config.init_from={self.init_from!r} is not an HF checkpoint directory (no config.json).")
        require(self.init_from or self.seq_len <= self.model.max_position_embeddings,
                f"--config.seq_len={self.seq_len} exceeds --config.model.max_position_embeddings="
                f"{self.model.max_position_embeddings}.")


def task_styles(task: str) -> tuple[str, ...]:
    """The target styles of a synthetic task: its format_target styles, and for code also "repair"
    (code_synthetic.repair_target: a wrong program, its execution feedback, the correct one)."""
    if task == "code":
        from areal_jax.data.code_synthetic import TARGET_STYLES

        return (*TARGET_STYLES, "repair")
    from areal_jax.data.synthetic_math import TARGET_STYLES

    return tuple(TARGET_STYLES)


def from_config_dict(config: Any) -> SFTConfig:
    """The typed SFTConfig of a config file's ConfigDict (an SFTConfig is returned as it is)."""
    if isinstance(config, SFTConfig):
        return config
    unknown = knobs.unknown_keys(SFTConfig, config)
    if unknown:
        known = list(knobs.field_types(SFTConfig))
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" Did you mean '--config.{close[0]}'?" if close else ""
        raise ConfigError(f"Unknown config key '{unknown[0]}'.{hint}")
    return knobs.from_mapping(SFTConfig, config)
