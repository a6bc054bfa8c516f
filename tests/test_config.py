"""The typed config tree: defaults unchanged, types / choices / relations checked with one-sentence errors
naming the key, the ml_collections layer (base_config, overrides) generated from the dataclasses, and an
RLJob whose construction fails half-way closes what it had opened."""
from __future__ import annotations

import dataclasses
import json
import os
import threading

import ml_collections
import pytest

from areal_jax import config as config_lib
from areal_jax import knobs
from areal_jax.config import ConfigError, JobConfig

# base_config() as it was written by hand before the typed tree (commit e065294): every key and default.
PREVIOUS_DEFAULTS = {
    "run_dir": "runs/default", "seed": 0, "total_steps": 100,
    "model.path": "", "model.tokenizer_path": "", "model.dtype": "float32", "model.param_dtype": "float32",
    "model.moe_impl": "auto",
    "data.train_path": "", "data.train_weights": "", "data.train_tasks": "", "data.task_overrides": "", "data.file_overrides": "", "data.test_tasks": "", "data.test_path": "", "data.question_field": "auto",  # was "question"; auto since "data.answer_field": "answer",
    "data.prompt_template": "Question: {question}\nAnswer:", "data.use_chat_template": False,
    "data.system_prompt": "", "data.max_prompt_len": 256, "data.on_bad_row": "error", "data.task": "math",
    "data.shuffle": True,
    "mesh.train_devices": None, "mesh.rollout_devices": None, "mesh.train_fraction": None, "mesh.fsdp": -1,
    "mesh.tensor": 1, "mesh.rollout_tensor": -1, "mesh.colocated": False,
    "rollout.group_size": 8, "rollout.max_new_tokens": 64, "rollout.max_len": 320, "rollout.num_slots": 64,
    "rollout.temperature": 1.0, "rollout.top_k": None, "rollout.top_p": None, "rollout.on_update": "recompute",
    "rollout.decode_steps": 4, "rollout.kv_cache": "dense", "rollout.page_size": 16, "rollout.kv_pages": None,
    "rollout.max_staleness": 4, "rollout.max_concurrent": None, "rollout.filter_uniform_groups": False,
    "rollout.retire_solved": 0, "rollout.retire_unsolved": 0,
    "rollout.advantage_mode": "grpo", "rollout.param_dtype": "same",
    "train.batch_groups": 16, "train.lr": 1e-5, "train.warmup_steps": 0, "train.schedule": "constant",
    "train.weight_decay": 0.0, "train.max_grad_norm": 1.0, "train.loss": "decoupled", "train.eps_clip": 0.2,
    "train.eps_clip_high": None, "train.behav_weight_cap": None, "train.behav_weight_mode": "mask",
    "train.dual_clip": None, "train.loss_agg": "token-mean", "train.prox_mode": "recompute",
    "train.ppo_minibatches": 1, "train.micro_batch_tokens": 4096, "train.kl_coef": 0.0, "train.kl_estimator": "k3",
    "train.entropy_coef": 0.0, "train.min_lr_ratio": 0.0, "train.logits_chunk": 512, "train.attention": "auto",
    "train.remat": "auto",
    "lora.enabled": False, "lora.rank": 16, "lora.alpha": 32.0, "lora.dropout": 0.0, "lora.targets": "all",
    "lora.base_dtype": "", "lora.sampler": "merged",
    "reward.fn": "math", "reward.num_workers": 2, "reward.timeout_s": 5.0, "reward.memory_mb": 4096,
    "reward.code_mode": "all_pass", "reward.code_case_timeout_s": 4.0, "reward.code_sample_timeout_s": 20.0,
    "eval.n_test": 500, "eval.at_start": True, "eval.at_end": True, "eval.every_steps": 0,
    "eval.max_new_tokens": 64, "eval.set_max_new_tokens": "", "eval.samples": 8, "eval.start_samples": -1, "eval.num_slots": 256,
    "eval.decode_steps": 0,
    "checkpoint.every_steps": 10, "checkpoint.every_minutes": 0.0, "checkpoint.keep": 2, "checkpoint.resume": True,
    "checkpoint.async_save": True, "checkpoint.hf_every_steps": 0, "checkpoint.hf_keep": 0, "checkpoint.hf_dtype": "auto",
    "log.every_steps": 1, "log.tensorboard": True, "log.timeline": True, "log.timeline_max_events": 1_000_000,
    "log.console": True, "log.param_digests": False, "log.wandb_project": "", "log.wandb_entity": "",
    "log.wandb_name": "", "log.wandb_mode": "online",
    "distributed.enabled": False, "distributed.coordinator_address": "", "distributed.num_processes": None,
    "distributed.process_id": None, "distributed.heartbeat_timeout_s": 60.0, "distributed.file_heartbeats": False,
}


def _validate(**overrides) -> JobConfig:
    c = config_lib.base_config()
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            c[section][name] = value
        else:
            c[section] = value
    return config_lib.validate(c, check_paths=False)


def test_defaults_are_the_previous_hand_written_ones():
    flat = config_lib._flatten(config_lib.base_config())
    for key, value in PREVIOUS_DEFAULTS.items():
        assert key in flat, key
        assert flat[key] == value and type(flat[key]) is type(value), (key, flat[key], value)
    job = config_lib.validate(config_lib.base_config(), check_paths=False)
    assert job == JobConfig()  # the tree's own defaults are base_config's
    # What the job derives instead of copying into a second key the user could set.
    assert job.rollout.eta == 4 and job.optimizer_steps == 100
    assert not hasattr(job.train, "max_staleness") and not hasattr(job.train, "total_steps")


def test_every_key_has_a_doc_and_choices_come_from_the_field():
    docs = config_lib.config_docs()
    assert set(docs) == set(config_lib._flatten(config_lib.base_config()))
    assert all(docs.values()), [k for k, v in docs.items() if not v]
    field = {f.name: f for f in dataclasses.fields(type(JobConfig().train))}["kl_estimator"]
    assert field.metadata["choices"] == ("k1", "k2", "k3")
    with pytest.raises(ConfigError, match=r"^--config\.train\.kl_estimator='k4' is not one of k1, k2, k3\.$"):
        _validate(train__kl_estimator="k4")
    with pytest.raises(ConfigError, match=r"lora\.base_dtype='x' is not one of '', float32, bfloat16"):
        _validate(lora__base_dtype="x")


@pytest.mark.parametrize("key, value, words", [
    ("train__lr", "fast", "--config.train.lr='fast' is a str, not a float"),
    ("train__batch_groups", None, "--config.train.batch_groups=None is not allowed: give an int"),
    ("rollout__group_size", True, "--config.rollout.group_size=True is a bool, not an int"),
    ("log__console", "yes", "--config.log.console='yes' is a str, not a bool"),
    ("rollout__top_p", "0.9", "--config.rollout.top_p='0.9' is a str, not a float (or None)"),
])
def test_wrong_types_are_config_errors(key, value, words):
    c = config_lib.base_config()
    section, name = key.split("__")
    c[section] = ml_collections.ConfigDict({**c[section].to_dict(), name: value})  # a config file's own dict
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        config_lib.validate(c, check_paths=False)


def test_int_is_accepted_for_a_float_and_stored_as_float():
    job = _validate(train__lr=1, reward__timeout_s=7)
    assert job.train.lr == 1.0 and type(job.train.lr) is float and type(job.reward.timeout_s) is float


@pytest.mark.parametrize("overrides, words", [
    ({"data__max_prompt_len": 300}, "data.max_prompt_len (300) + rollout.max_new_tokens (64) exceeds rollout.max_len"),
    ({"train__micro_batch_tokens": 100}, "--config.train.micro_batch_tokens=100 is smaller than rollout.max_len=320"),
    ({"train__schedule": "cosine", "train__warmup_steps": 100}, "total_steps x train.ppo_minibatches = 100 optimizer steps must exceed"),
    ({"data__task": "code"}, "--config.reward.fn=code"),
    ({"reward__fn": "nomodule"}, "--config.reward.fn='nomodule' is neither a built-in"),
    ({"rollout__max_staleness": -1}, "both unset"),
    ({"train__ppo_minibatches": 3}, "--config.train.batch_groups=16 is not divisible by --config.train.ppo_minibatches=3"),
    ({"eval__samples": -1}, "--config.eval.samples=-1 must be >= 0"),
    ({"eval__start_samples": -2}, "--config.eval.start_samples=-2 must be -1"),
    ({"checkpoint__keep": 0}, "--config.checkpoint.keep=0 must be at least 1"),
    ({"checkpoint__every_minutes": -1.0}, "--config.checkpoint.every_minutes=-1.0 must be >= 0"),
    ({"checkpoint__hf_every_steps": -2}, "--config.checkpoint.hf_every_steps=-2 must be >= 0"),
    ({"data__task": "code", "reward__fn": "code", "reward__timeout_s": 30.0, "reward__code_time_limit_factor": -1.0},
     "--config.reward.code_time_limit_factor=-1.0 must be >= 0"),
])
def test_ranges_and_relations_name_the_keys(overrides, words):
    with pytest.raises(ConfigError) as e:
        _validate(**overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_unknown_keys_and_override_values():
    c = config_lib.base_config()
    c.train.unlock()
    c.train.eps_clipp = 0.3
    with pytest.raises(ConfigError, match=r"Unknown config key 'train\.eps_clipp'\. Did you mean '--config\.train\.eps_clip'"):
        config_lib.validate(c, check_paths=False)
    with pytest.raises(ConfigError, match=r"Did you mean '--config\.rollout\.group_size'"):
        config_lib.check_override_flags(["--config.rollout.groupsize=4"])
    with pytest.raises(ConfigError, match=r"--config\.train\.batch_groups='abc' is not an int: give e\.g\."):
        config_lib.check_override_flags(["--config.train.batch_groups=abc"])
    config_lib.check_override_flags(["--config.rollout.top_k=None", "--config.train.lr=3e-5", "--config=x.py",
                                     "--config.model.path=/m", "--config.log.console=false"])


def test_none_overrides_of_optional_keys_reach_the_config():
    """`--config.k=None` on an optional number key: flag parsing would read 'None' as the key's type, so the
    override is taken out before it and set after; the last override of a key wins."""
    argv = ["--config=x.py", "--config.train.dual_clip=None", "--config.rollout.top_k=None", "--config.rollout.top_k=5",
            "--config.train.lr=3e-5", "--config.train.behav_weight_cap=2", "--config.train.behav_weight_cap=None",
            "--config.model.path=None"]  # a str key keeps the text
    kept, keys = config_lib.split_none_overrides(argv)
    assert kept == ["--config=x.py", "--config.rollout.top_k=5", "--config.train.lr=3e-5",
                    "--config.train.behav_weight_cap=2", "--config.model.path=None"]
    assert keys == ["train.dual_clip", "train.behav_weight_cap"]
    c = config_lib.base_config()
    c.train.dual_clip, c.train.behav_weight_cap = 3.0, 2.0
    job = config_lib.validate(config_lib.apply_none_overrides(c, keys), check_paths=False)
    assert job.train.dual_clip is None and job.train.behav_weight_cap is None


def test_sections_validate_on_their_own_and_round_trip_through_json():
    from areal_jax.sampler.config import RolloutConfig

    with pytest.raises(ConfigError, match=r"--config\.rollout\.num_slots=2 is smaller than --config\.rollout\.group_size=8"):
        RolloutConfig(num_slots=2)
    assert RolloutConfig(max_staleness=None, max_concurrent=8).eta is None
    job = _validate(total_steps=7, train__lr=3e-4, rollout__max_staleness=0, lora__enabled=True)
    again = knobs.from_mapping(JobConfig, json.loads(job.to_json()))  # what export reads from config.json
    assert again == job and again.rollout.eta == 0


def test_a_new_key_in_a_section_appears_in_base_config_and_help():
    @dataclasses.dataclass(frozen=True)
    class Probe(knobs.Section):
        section = "probe"
        depth: int = knobs.knob(3, "how deep", choices=(1, 2, 3))
        rate: float | None = knobs.knob(None, "how fast")

    assert knobs.defaults_dict(Probe) == {"depth": 3, "rate": None}
    assert knobs.docs(Probe, "probe.") == {"probe.depth": "how deep (1 | 2 | 3)", "probe.rate": "how fast"}
    assert knobs.from_mapping(Probe, {"rate": 2}) == Probe(rate=2.0)
    with pytest.raises(ConfigError, match=r"--config\.probe\.depth=4 is not one of 1, 2, 3\."):
        Probe(depth=4)


def _live_sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sampler-loop" and t.is_alive()]


def test_failure_half_way_through_construction_closes_what_was_opened(tmp_path, monkeypatch):
    """The controller (the last part built) fails: the reward workers, the sampler thread and the logs
    opened before it are closed, and the run directory holds a saved timeline."""
    from areal_jax.rewards import pool as pool_mod
    from areal_jax.system import job as job_mod
    from areal_jax.testing.tiny import tiny_config

    pools = []

    class RecordingPool(pool_mod.RewardPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.started = [w.process for w in self._workers]
            pools.append(self)

    def failing_controller(*args, **kwargs):
        raise RuntimeError("controller construction failed")

    monkeypatch.setattr(pool_mod, "RewardPool", RecordingPool)
    monkeypatch.setattr(job_mod, "RolloutController", failing_controller)
    before = set(_live_sampler_threads())
    c = tiny_config(str(tmp_path), run_dir=str(tmp_path / "run"))
    with pytest.raises(RuntimeError, match="controller construction failed"):
        job_mod.RLJob(c, log_fn=lambda *a, **k: None)
    assert len(pools) == 1 and pools[0].started
    for p in pools[0].started:
        p.join(10)
    assert not any(p.is_alive() for p in pools[0].started), "the reward workers outlived the failed job"
    assert set(_live_sampler_threads()) <= before
    assert os.path.exists(tmp_path / "run" / "timeline.json")  # the timeline was closed (saved)


def test_job_is_a_context_manager_and_a_second_close_does_nothing(tmp_path):
    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config

    c = tiny_config(str(tmp_path), run_dir=str(tmp_path / "run"))
    with RLJob(c, log_fn=lambda *a, **k: None) as job:
        assert job.config.rollout.eta == 1 and isinstance(job.config, JobConfig)
        pool = job.reward_pool
        workers = [w.process for w in pool._workers]
        assert workers and all(p.is_alive() for p in workers)
    for p in workers:
        p.join(10)
    assert not any(p.is_alive() for p in workers)
    assert not _live_sampler_threads()
    job.close()  # nothing left to close


def test_sft_configs_convert_and_bad_stages_are_config_errors():
    from areal_jax.knobs import load_config_file
    from areal_jax.programs.sft_config import SFTConfig, StageConfig, from_config_dict

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    loaded = {}
    for name in ("sft_math", "sft_code"):
        path = os.path.join(root, "configs", f"{name}.py")
        loaded[name] = (load_config_file(path), from_config_dict(load_config_file(path)))
    cd, typed = loaded["sft_code"]
    assert isinstance(typed, SFTConfig) and typed.task == "code" and typed.seq_len == cd.seq_len
    assert [s.name for s in typed.stages] == ["correct", "mix"] and isinstance(typed.stages[1], StageConfig)
    assert typed.stages[1].mix == {"confused": 0.55, "correct": 0.3, "slip": 0.15}
    assert loaded["sft_math"][1].task == "math"  # the key sft_math.py leaves out takes its default
    bad = loaded["sft_math"][0]
    bad.stages[1].mix = {"worked": "lots"}
    with pytest.raises(ConfigError, match=r"mix\['worked'\]='lots' is a str, not a float"):
        from_config_dict(bad)
    bad.stages[1] = ml_collections.ConfigDict(dict(name="x", mix={"worked": 1.0}, learning_rate=1e-3))
    with pytest.raises(ConfigError, match=r"--config\.stages\[1\] has no key 'learning_rate'"):
        from_config_dict(bad)
    with pytest.raises(ConfigError, match=r"Unknown config key 'model\.layers'\. Did you mean '--config\.model\.num_layers'"):
        from_config_dict({**loaded["sft_math"][0].to_dict(), "model": {"layers": 2}})


def test_config_files_build_on_each_other_from_any_directory(tmp_path, monkeypatch):
    """load_config_file: a config file that builds on another by a path relative to itself gets the same values
    from any working directory; a missing file or one without get_config() is a ConfigError naming it."""
    from areal_jax.config import load_config_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(tmp_path)
    lora = load_config_file(os.path.join(root, "configs", "math_lora.py"))
    math = load_config_file("math.py", os.path.join(root, "configs", "math_lora.py"))
    assert lora.lora.enabled and not math.lora.enabled
    assert lora.data.train_path == math.data.train_path and lora.rollout.to_dict() == math.rollout.to_dict()
    with pytest.raises(ConfigError, match=r"No config file '.*nope\.py'"):
        load_config_file("nope.py", os.path.join(root, "configs", "math.py"))
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(ConfigError, match=r"empty\.py' defines no get_config\(\)"):
        load_config_file(str(tmp_path / "empty.py"))
