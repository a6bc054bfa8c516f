"""What a new user meets: mistakes in the data or on the command line end in one sentence naming the
config key (exit status 2), and `--help` / `--config.help` say what the keys are."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from areal_jax import config as config_lib
from areal_jax.config import ConfigError
from areal_jax.system.job import RLJob
from areal_jax.testing.processes import cpu_env
from areal_jax.testing.tiny import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "areal_jax.main", *args], env=cpu_env(1), cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("assets"))
    tiny_config(directory)  # writes the tiny model and data
    return directory


def _config(assets, tmp_path, **data):
    c = tiny_config(assets, run_dir=str(tmp_path / "run"), write=False)
    for k, v in data.items():
        section, key = k.split("__")
        c[section][key] = v
    return c


def _one_sentence_naming(err: ConfigError, key: str) -> None:
    msg = str(err)
    assert "\n" not in msg, msg
    assert key in msg, msg


def test_malformed_row_names_the_on_bad_row_key(assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = open(os.path.join(assets, "data", "train.jsonl")).read().splitlines()[:5]
    lines.insert(3, '{"question": "two plus two", "answer": ')  # line 4: cut off
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        RLJob(_config(assets, tmp_path, data__train_path=str(bad)), log_fn=lambda *a: None)
    _one_sentence_naming(e.value, "--config.data.on_bad_row=skip")
    assert "bad.jsonl, line 4: invalid JSON" in str(e.value)
    assert "on_bad_row='skip'" not in str(e.value)  # the Python argument is not what a user types


def test_model_directory_without_tokenizer(assets, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(os.path.join(assets, "model"), model)
    os.remove(model / "tokenizer.json")
    with pytest.raises(ConfigError) as e:
        RLJob(_config(assets, tmp_path, model__path=str(model)), log_fn=lambda *a: None)
    _one_sentence_naming(e.value, "--config.model.tokenizer_path")
    assert "tokenizer.json" in str(e.value)


def test_empty_test_file(assets, tmp_path):
    empty = tmp_path / "test.jsonl"
    empty.write_text("")
    c = _config(assets, tmp_path, data__test_path=str(empty))
    c.eval.n_test = 4
    with pytest.raises(ConfigError) as e:
        RLJob(c, log_fn=lambda *a: None)
    _one_sentence_naming(e.value, "--config.data.test_path")
    assert "--config.eval.n_test=0" in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write a read-only directory")
def test_run_dir_not_writable_as_user(assets, tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir()
    os.chmod(parent, 0o500)
    c = _config(assets, tmp_path)
    c.run_dir = str(parent / "run")
    try:
        with pytest.raises(ConfigError) as e:
            RLJob(c, log_fn=lambda *a: None)
    finally:
        os.chmod(parent, 0o700)
    _one_sentence_naming(e.value, "--config.run_dir")


def test_run_dir_not_writable(assets, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # a run directory under a file cannot be made, even by root
    c = _config(assets, tmp_path)
    c.run_dir = str(blocker / "run")
    with pytest.raises(ConfigError) as e:
        RLJob(c, log_fn=lambda *a: None)
    _one_sentence_naming(e.value, "--config.run_dir")


def test_cli_error_is_one_line_with_exit_status_2(assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')  # no answer field
    out = _main(f"--config={ROOT}/configs/tiny.py:{assets}", f"--config.data.train_path={bad}",
                f"--config.run_dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("Config error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "line 1: field 'answer' is missing" in errors[0] and "--config.data.on_bad_row=skip" in errors[0]


def test_help_shows_config_files_and_most_used_keys_with_their_docs():
    out = _main("--help", timeout=120)
    assert out.returncode == 0, out.stderr
    docs = config_lib.config_docs()
    from areal_jax.programs.rl import MOST_USED_KEYS

    assert len(MOST_USED_KEYS) == 10 and "configs/math.py" in out.stdout and "--config.help" in out.stdout
    for key in MOST_USED_KEYS:
        assert docs[key], f"{key} has no doc comment in config.base_config"
        line = next(line for line in out.stdout.splitlines() if line.strip().startswith(f"--config.{key} "))
        assert docs[key] in line


def test_config_help_lists_every_key_with_the_comment_beside_its_default():
    out = _main("--config.help", timeout=120)
    assert out.returncode == 0, out.stderr
    flat = config_lib._flatten(config_lib.base_config())
    listed = [line.split("=", 1)[0].strip() for line in out.stdout.splitlines() if line.strip().startswith("--config.")]
    assert sorted(listed) == sorted(f"--config.{k}" for k in flat)
    # Docs live in the sections' fields: check two against the field metadata found independently.
    import dataclasses

    from areal_jax.evaluation.scoring import EvalConfig
    from areal_jax.sampler.config import RolloutConfig

    for cls, key in ((RolloutConfig, "on_update"), (EvalConfig, "n_test")):
        field = next(f for f in dataclasses.fields(cls) if f.name == key)
        doc = config_lib.config_docs()[f"{cls.section}.{key}"]
        assert doc == field.metadata["doc"] and f"--config.{cls.section}.{key}" in out.stdout
        line = next(line for line in out.stdout.splitlines() if line.strip().startswith(f"--config.{cls.section}.{key}="))
        assert line.rstrip().endswith(doc)
    # A field without its allowed values in its doc gets them appended.
    assert config_lib.config_docs()["train.kl_estimator"].endswith("(k1 | k2 | k3)")
    assert config_lib.config_docs()["rollout.max_staleness"].startswith("eta;")
    assert json.dumps(config_lib.config_docs())  # plain data
