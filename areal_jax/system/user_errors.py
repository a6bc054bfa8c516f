"""Mistakes a user can make from the command line or in the data, turned into one-sentence
ConfigErrors that name the config key to change (main prints them on one line and exits with 2).

    with user_errors.data_file("data.train_path", path):
        prompts = make_prompt_iterator(path, ...)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator

from areal_jax.config import ConfigError

if TYPE_CHECKING:
    from areal_jax.models.config import ModelConfig

__all__ = ["check_same_model", "data_file", "model_dir", "model_signature", "one_line", "restore_failed", "run_dir",
           "tokenizer_dir"]

# Model fields whose change makes a checkpoint unusable (shapes, or the meaning of the weights).
_SIGNATURE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "tie_word_embeddings")


def one_line(err: BaseException | str) -> str:
    """The message of `err` with its lines joined by spaces."""
    return " ".join(str(err).split())


@contextlib.contextmanager
def run_dir(path: str) -> Iterator[None]:
    """Creating or writing the run directory failed (permissions, a file in the way, a full disk)."""
    try:
        yield
    except OSError as e:
        reason = e.strerror or one_line(e)
        raise ConfigError(f"The run directory {path!r} cannot be written ({reason}); choose one you can write "
                          "with --config.run_dir=PATH.") from e


@contextlib.contextmanager
def tokenizer_dir(model_path: str, tokenizer_path: str) -> Iterator[None]:
    """The tokenizer directory (model.tokenizer_path, else model.path) holds no usable tokenizer."""
    try:
        yield
    except (FileNotFoundError, ValueError) as e:
        where = (f"--config.model.tokenizer_path={tokenizer_path!r}" if tokenizer_path
                 else f"--config.model.path={model_path!r}")
        raise ConfigError(f"No usable tokenizer in {where}: {one_line(e)} Point --config.model.tokenizer_path at "
                          "a directory with tokenizer.json (e.g. the one the model came from).") from e


@contextlib.contextmanager
def data_file(key: str, path: str) -> Iterator[None]:
    """Reading a data file failed: a malformed row (with data.on_bad_row=error), no usable rows, or
    every prompt too long. key: "data.train_path" or "data.test_path"."""
    from areal_jax.data.readers import BadRowError

    try:
        yield
    except BadRowError as e:
        raise ConfigError(f"{e.problem} Fix the row, or skip such rows with --config.data.on_bad_row=skip.") from e
    except (ValueError, FileNotFoundError) as e:
        msg = one_line(e)
        if "on_bad_row" in msg and "--config.data.on_bad_row" not in msg:
            msg = msg.replace("on_bad_row='skip'", "--config.data.on_bad_row=skip")
        hint = (" Fix the file, or turn evaluation off with --config.eval.n_test=0." if key == "data.test_path"
                else f" Fix the file or point --config.{key} at another one.")
        raise ConfigError(f"--config.{key}={path!r}: {msg}{hint}") from e


@contextlib.contextmanager
def model_dir(model_path: str) -> Iterator[None]:
    """The model directory's weights or config.json do not make a model (missing or misshaped tensors)."""
    try:
        yield
    except (KeyError, ValueError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"--config.model.path={model_path!r} does not hold a usable checkpoint: {one_line(msg)} "
                          "Point it at a complete HF model directory.") from e


def model_signature(model_config: ModelConfig | dict) -> dict:
    """The fields of a ModelConfig that a checkpoint's shapes depend on (JSON-able)."""
    fields = dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else dict(model_config)
    return {k: fields[k] for k in _SIGNATURE_FIELDS if k in fields}


def check_same_model(saved: dict | None, current: dict, run_dir_path: str, model_path: str) -> None:
    """Raise ConfigError when a run directory's checkpoints were made with a different model."""
    if not saved:
        return  # checkpoints written before the signature was recorded: the restore itself checks shapes
    differs = {k: (saved.get(k), current.get(k)) for k in current if saved.get(k) != current.get(k)}
    if differs:
        details = ", ".join(f"{k} {a} there, {b} now" for k, (a, b) in sorted(differs.items()))
        raise ConfigError(
            f"The checkpoints in {run_dir_path!r} were made with a different model than "
            f"--config.model.path={model_path!r} ({details}); resume with the model the run started from, or "
            "start a new run with another --config.run_dir (or --config.checkpoint.resume=False).")


def restore_failed(err: BaseException, run_dir_path: str, model_path: str) -> ConfigError:
    """A checkpoint that does not fit the model (shapes or structure) as a ConfigError."""
    return ConfigError(
        f"The checkpoint in {run_dir_path!r} does not fit the model at --config.model.path={model_path!r} "
        f"({one_line(err)[:300]}); resume with the model the run started from, or start a new run with another "
        "--config.run_dir (or --config.checkpoint.resume=False).")
