"""The job's config tree: one typed section per part, and the ml_collections layer around it.

Each part owns its section, a frozen dataclass whose fields carry the option's default, allowed
values and doc (areal_jax.knobs): `model` (models.hf_io.ModelLoadConfig), `data` (data.pipeline.
DataConfig), `mesh` (runtime.mesh.MeshConfig), `rollout` (sampler.config.RolloutConfig), `train`
(trainer.config.TrainerConfig), `lora` (models.lora.LoRAConfig), `reward` (rewards.pool.RewardConfig),
`eval` (evaluation.scoring.EvalConfig), `checkpoint` (checkpoint.CheckpointConfig), `log`
(metrics.LogConfig) and `distributed` (runtime.distributed.DistributedConfig). `JobConfig` holds them
with the job-level keys (run_dir, seed, total_steps) and checks the relations between sections.

Config files and `--config.x.y=value` overrides stay ml_collections: `base_config()` is generated from
the dataclasses, and `validate(config)` converts the ConfigDict once, at start-up, into a JobConfig,
raising `ConfigError`s that say what was wrong and how to fix it before anything is compiled or loaded.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any, ClassVar

import ml_collections

from areal_jax import knobs
from areal_jax.checkpoint import CheckpointConfig
from areal_jax.data.pipeline import DataConfig
from areal_jax.evaluation.scoring import EvalConfig
from areal_jax.knobs import ConfigError, Section, knob, load_config_file, require
from areal_jax.metrics import LogConfig
from areal_jax.models.hf_io import ModelLoadConfig
from areal_jax.models.lora import LoRAConfig
from areal_jax.rewards.pool import RewardConfig
from areal_jax.runtime.distributed import DistributedConfig
from areal_jax.runtime.mesh import MeshConfig
from areal_jax.sampler.config import RolloutConfig
from areal_jax.trainer.config import TrainerConfig

__all__ = ["ConfigError", "JobConfig", "apply_none_overrides", "base_config", "check_override_flags",
           "config_docs", "config_help", "from_config_dict", "load_config_file", "split_none_overrides", "validate"]


@dataclasses.dataclass(frozen=True)
class JobConfig(Section):
    """A whole RL job: the job-level keys and one section per part, each validated on construction;
    the relations between sections are checked here."""

    section: ClassVar[str] = ""

    run_dir: str = knob("runs/default", "metrics, checkpoints, timeline, summary.json; an existing run resumes")
    seed: int = knob(0, "data order, sampling noise and initialisation")
    total_steps: int = knob(100, "trainer updates (policy versions) to run")
    model: ModelLoadConfig = dataclasses.field(default_factory=ModelLoadConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    train: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    @property
    def optimizer_steps(self) -> int:
        """Steps the learning-rate schedule spans: one per PPO minibatch of every update."""
        return self.total_steps * self.train.ppo_minibatches

    def check(self) -> None:
        r, t = self.rollout, self.train
        require(self.total_steps >= 1, f"--config.total_steps={self.total_steps} must be at least 1.")
        from areal_jax.data.sources import files_as_read
        from areal_jax.evaluation.sets import parse_eval_sets, parse_set_budgets

        if self.eval.set_max_new_tokens.strip():
            try:
                names = [s.name for s in parse_eval_sets(self.data.test_path)]
                parse_set_budgets(self.eval.set_max_new_tokens, names)
            except ValueError as e:
                require(False, str(e))

        for where, d in files_as_read(self.data):  # the data section, each task's and each file's overrides
            require(d.max_prompt_len + r.max_new_tokens <= r.max_len,
                    f"{where}.max_prompt_len ({d.max_prompt_len}) + rollout.max_new_tokens ({r.max_new_tokens}) "
                    f"exceeds rollout.max_len ({r.max_len}); raise --config.rollout.max_len or lower one of them.")
        require(t.micro_batch_tokens >= r.max_len,
                f"--config.train.micro_batch_tokens={t.micro_batch_tokens} is smaller than rollout.max_len="
                f"{r.max_len}: the longest sequence must fit one micro-batch.")
        require(t.schedule != "cosine" or self.optimizer_steps > t.warmup_steps,
                f"The cosine schedule's total_steps x train.ppo_minibatches = {self.optimizer_steps} optimizer steps "
                f"must exceed --config.train.warmup_steps={t.warmup_steps}; raise total_steps or use "
                "--config.train.schedule=constant.")
        from areal_jax.data.sources import file_tasks

        fn = self.reward.fn
        tasks = (set(file_tasks(self.data, "train")) | (set(file_tasks(self.data, "test")) if self.eval.enabled else set())
                 or {self.data.task})  # no files named yet: the task the files will be read as
        mixed = len(tasks) > 1
        require(not (tasks == {"code"} and fn in ("math", "exact")),
                f"--config.data.task=code gives hidden tests as answers, which reward.fn={fn!r} cannot score; pass "
                "--config.reward.fn=code.")
        require(not (mixed and fn in ("math", "exact", "code")),
                f"data.train_tasks / data.test_tasks mix math and programming tasks, which reward.fn={fn!r} cannot "
                "all score; pass --config.reward.fn=mixed (each row scored by its task's reward).")
        require(not (fn == "code" and tasks != {"code"}),
                "--config.reward.fn=code needs programming tasks with tests; pass --config.data.task=code.")
        require(r.feedback_turns == 0 or fn == "code",
                f"--config.rollout.feedback_turns={r.feedback_turns} runs each program on its task's tests for "
                "feedback: it needs --config.reward.fn=code (and data.task=code).")
        require(self.eval.feedback_turns <= 0 or fn == "code",
                f"--config.eval.feedback_turns={self.eval.feedback_turns} runs each program on its task's tests for "
                "feedback: it needs --config.reward.fn=code (and data.task=code).")
        require(r.feedback_template != "chat" or self.data.use_chat_template
                or max(r.feedback_turns, self.eval.feedback_turns) <= 0,
                "--config.rollout.feedback_template=chat frames the feedback as a chat turn, but the prompts are not "
                "chats: pass --config.data.use_chat_template=True, or write the frame out in feedback_template.")
        from areal_jax import paths

        try:
            run_dir = paths.run_path(self.run_dir)
            paths.checkpoint_directory(run_dir)
        except ValueError as e:
            raise ConfigError(f"--config.run_dir: {e}") from None
        require(not self.distributed.file_heartbeats or paths.is_local(run_dir),
                f"distributed.file_heartbeats needs a local run_dir that every process sees, not {self.run_dir!r}; "
                "peers are detected without it (--config.distributed.file_heartbeats=False).")

    def to_json(self) -> str:
        return json.dumps(knobs.to_dict(self), indent=1)


def base_config() -> ml_collections.ConfigDict:
    """Every key the system reads, with its default (from the JobConfig tree). Config files override a
    subset. An optional key (`int | None`) accepts None or a value of its type."""
    types = knobs.field_types(JobConfig)

    def build(defaults: dict, prefix: str) -> ml_collections.ConfigDict:
        c = ml_collections.ConfigDict()
        for name, default in defaults.items():
            if isinstance(default, dict):
                c[name] = build(default, f"{prefix}{name}.")
                continue
            hint = types[prefix + name]
            plain = knobs.scalar_type(hint)
            if plain is not None and _optional(hint):  # typed even while None: overrides are parsed as `plain`
                c[name] = ml_collections.FieldReference(default, field_type=plain)
            else:
                c[name] = default
        return c

    return build(knobs.defaults_dict(JobConfig), "")


def _optional(hint: Any) -> bool:
    try:
        knobs.coerce("", None, hint)
        return True
    except ConfigError:
        return False


def config_docs() -> dict[str, str]:
    """{key: doc} for every key of base_config, from the fields' docs (allowed values appended)."""
    return knobs.docs(JobConfig)


def _flatten(c: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in c.items():
        key = f"{prefix}{k}"
        if isinstance(v, ml_collections.ConfigDict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_help(config: ml_collections.ConfigDict | None = None) -> str:
    """Every key with its value (the defaults, or `config`'s) and its doc, one line each, in field order."""
    docs = config_docs()
    flat = _flatten(config if config is not None else base_config())
    lines = []
    for key in list(docs) + [k for k in flat if k not in docs]:
        head = f"{key}={flat.get(key)!r}"
        lines.append(f"  --config.{head:<40} {docs.get(key, '')}".rstrip())
    return "\n".join(lines)


def _unknown_key_error(key: str, known: list[str], shown: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean '--config.{close[0]}'?" if close else ""
    return ConfigError(f"Unknown config key {shown}.{hint} `python -m areal_jax.main --config.help` lists every key.")


def _check_keys(config: ml_collections.ConfigDict) -> None:
    known = list(knobs.field_types(JobConfig))
    for key in _flatten(config):
        if key not in known:
            raise _unknown_key_error(key, known, f"'{key}'")


def check_override_flags(argv: list[str]) -> None:
    """Raise ConfigError for a `--config.x.y=value` command-line override naming an unknown key, or
    whose value is not a number where the key takes one.

    Runs before flag parsing, whose own error for this case is a stack of KeyError / AttributeError.
    """
    types = knobs.field_types(JobConfig)
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key, has_value, text = arg[len("--config."):].partition("=")
        if key not in types:
            raise _unknown_key_error(key, list(types), f"in the override '{arg}'")
        if has_value:
            knobs.parse_override(key, text, types[key])


def split_none_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without its `--config.x.y=None` overrides of optional keys, the keys the command line leaves None).

    Flag parsing reads an override as its key's type (`float('None')` fails), so these are taken out before it
    and set on the parsed config by ``apply_none_overrides``. A key's last override wins, as in flag parsing:
    `--config.k=None --config.k=3` leaves 3.
    """
    types = knobs.field_types(JobConfig)
    last_is_none: dict[str, bool] = {}
    kept = []
    for arg in argv:
        key, has_value, text = arg[len("--config."):].partition("=") if arg.startswith("--config.") else ("", "", "")
        if not (has_value and key in types):
            kept.append(arg)
            continue
        last_is_none[key] = text == "None" and _optional(types[key])
        if not last_is_none[key]:
            kept.append(arg)
    return kept, [k for k, none in last_is_none.items() if none]


def apply_none_overrides(config: ml_collections.ConfigDict, keys: list[str]) -> ml_collections.ConfigDict:
    """Set each dotted key of ``split_none_overrides`` to None on the parsed config (in place; returned)."""
    for key in keys:
        *path, name = key.split(".")
        section = config
        for part in path:
            section = section[part]
        section[name] = None
    return config


def from_config_dict(config: ml_collections.ConfigDict | dict) -> JobConfig:
    """The typed tree of a config file's ConfigDict: unknown keys, wrong types, values out of range and
    inconsistent sections raise ConfigError. Keys the ConfigDict lacks keep their defaults."""
    if isinstance(config, ml_collections.ConfigDict):
        _check_keys(config)
    return knobs.from_mapping(JobConfig, config)


def validate(config: ml_collections.ConfigDict | JobConfig, *, check_paths: bool = True) -> JobConfig:
    """The typed JobConfig of `config` (a ConfigDict is converted); raises ConfigError on the first
    problem found.

    Checks that need only the config run here (keys, types, ranges, relations between values); with
    check_paths, also that the model and data paths exist and the run_dir's storage client is installed.
    Device-count checks run in runtime.mesh once devices are known, still before any compile.
    """
    job = config if isinstance(config, JobConfig) else from_config_dict(config)
    _check_learning(job)
    if check_paths:
        _check_paths(job)
    return job


def _check_learning(job: JobConfig) -> None:
    """A training run that would learn nothing: group advantages over groups whose samples cannot differ. (Not part
    of JobConfig.check: an evaluation may decode greedily.)"""
    r, t = job.rollout, job.train
    if t.critic != "none":
        return  # a learned baseline gives every sample its own advantage
    require(r.group_size >= 2,
            f"--config.rollout.group_size={r.group_size}: group advantages compare a prompt's samples with each "
            "other, so with one sample every advantage is 0 and nothing is learned. Raise group_size to 2 or more, "
            "or learn a baseline with --config.train.critic=value_head.")
    require(r.temperature > 0 and r.top_k != 1,
            f"--config.rollout.temperature={r.temperature} / top_k={r.top_k} decodes greedily: a group's "
            f"{r.group_size} samples are one and the same completion, so every group advantage is 0 and nothing "
            "is learned. Sample (temperature > 0, top_k None or >= 2), or use --config.train.critic=value_head.")


def _check_paths(job: JobConfig) -> None:
    from areal_jax import paths

    try:
        paths.check_backend(job.run_dir)  # the object store's client package is installed
    except ValueError as e:
        raise ConfigError(f"--config.run_dir: {e}") from None
    m, d = job.model, job.data
    require(bool(m.path), "--config.model.path is empty: point it at an HF checkpoint directory.")
    require(os.path.isdir(m.path), f"--config.model.path={m.path!r} is not a directory. Point it at an HF checkpoint "
            "directory (config.json + model.safetensors).")
    require(bool(d.train_path), "--config.data.train_path is empty: point it at a JSONL or Parquet file.")
    from areal_jax.data.sources import missing_files, parse_named_paths

    for key in ("train_path", "test_path"):
        files = parse_named_paths(getattr(d, key), f"data.{key}")  # well-formed: DataConfig.check
        for f in files:
            why = missing_files(f.path)
            require(why is None, f"--config.data.{key}={f.path!r} {why}." if len(files) == 1
                    else f"--config.data.{key}: {f.path!r} (the file named {f.name!r}) {why}.")
    require(not job.eval.enabled or bool(d.test_path),
            "eval is on but data.test_path is empty; set it or --config.eval.n_test=0.")
