"""Several data files under one config key: ``data.train_path`` (a training mixture) and ``data.test_path``
(several evaluation sets, areal_jax.evaluation.sets) take a comma-separated list of ``NAME=PATH`` or bare ``PATH``
items (a bare path is named by its file's stem). A path may be a glob pattern or a directory: its *.jsonl /
*.parquet files (a dataset's shards), in name order, read as one file (named by the directory).

Training from several files:

    --config.data.train_path=gsm8k=/data/gsm8k/train.jsonl,math=/data/math/train.jsonl
    --config.data.train_weights=0.3,0.7          # optional

Without weights the files form one dataset: every row of every file once per epoch. With weights (one per file,
any positive scale) each file is shuffled and repeated on its own and the stream draws from them in those
proportions, so a small file is seen more often than its share of the rows. With several files a task's uid is
"<name>:<row>:<epoch>" (with weights, the file's own epoch), and every step also logs each file's reward, accuracy
and group count (``source/<name>/...``). ``data.train_tasks=math,code`` (and ``data.test_tasks`` for the evaluation
sets) gives each file its task: math and programming tasks in one run, each row scored by its own reward
(``reward.fn=mixed``, areal_jax.rewards.mixed).
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
from typing import Any, Callable, Sequence

import numpy as np

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclasses.dataclass(frozen=True)
class NamedPath:
    name: str
    path: str


GLOB_CHARS = "*?["
DATA_SUFFIXES = (".jsonl", ".parquet")


def is_pattern(path: str) -> bool:
    """Whether ``path`` names several files: a glob pattern or a directory."""
    return any(c in path for c in GLOB_CHARS) or os.path.isdir(path)


def expand_files(path: str) -> list[str]:
    """The data files ``path`` names, sorted: a glob pattern's matches or a directory's files (each *.jsonl or
    *.parquet: the shards of a dataset), else the path itself. [] when a pattern matches none."""
    if any(c in path for c in GLOB_CHARS):
        matches = glob.glob(path)
    elif os.path.isdir(path):
        matches = [os.path.join(path, name) for name in os.listdir(path)]
    else:
        return [path]
    return sorted(m for m in matches if m.endswith(DATA_SUFFIXES) and os.path.isfile(m))


def missing_files(path: str) -> str | None:
    """Why ``path`` names no data (a missing file, or a pattern / directory without *.jsonl or *.parquet files), or
    None when it names some."""
    if is_pattern(path):
        return None if expand_files(path) else "matches no .jsonl or .parquet file"
    return None if os.path.exists(path) else "does not exist"


def parse_named_paths(value: str, key: str) -> list[NamedPath]:
    """The files of ``value`` ("" -> none). A ValueError names ``key`` and what is wrong: an empty item, a name that
    is not letters, digits, ``_ . -``, or two files of one name (two files of one stem must be named)."""
    if not value.strip():
        return []
    out: list[NamedPath] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"--config.{key}={value!r} has an empty item: separate files by single commas, "
                             "each NAME=PATH or PATH.")
        name, sep, path = item.partition("=")
        if sep and not os.path.exists(item) and "/" not in name:
            if not NAME.match(name):
                raise ValueError(f"--config.{key}: the name {name!r} may only hold letters, digits, '_', '.' and '-'.")
        else:
            path = item
            last = path.rstrip("/")
            if is_pattern(path):  # a pattern or a directory: named by its directory
                last = os.path.dirname(last) if any(c in os.path.basename(last) for c in GLOB_CHARS) else last
            name = os.path.splitext(os.path.basename(last))[0] or "data"
        if not path:
            raise ValueError(f"--config.{key}: {name!r} names no file (NAME=PATH).")
        if any(s.name == name for s in out):
            raise ValueError(f"--config.{key}: two files are named {name!r}; name them apart as NAME=PATH,NAME=PATH.")
        out.append(NamedPath(name, path))
    return out


def parse_weights(value: str, count: int, key: str = "data.train_weights") -> list[float] | None:
    """The mixture weights of ``value`` ("" -> None: no mixture), one positive number per file of the list."""
    if not value.strip():
        return None
    try:
        weights = [float(w) for w in value.split(",")]
    except ValueError:
        raise ValueError(f"--config.{key}={value!r} is not a comma-separated list of numbers (e.g. 0.3,0.7).") from None
    if len(weights) != count:
        raise ValueError(f"--config.{key}={value!r} gives {len(weights)} weight(s) for {count} file(s) of "
                         "data.train_path: give one per file, in its order.")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"--config.{key}={value!r}: every weight must be a positive number.")
    return weights


TASKS = ("math", "code")


def file_tasks(data: Any, split: str) -> list[str]:
    """The task of each file of data.<split>_path ("train" / "test"): data.<split>_tasks, one per file in order, or
    data.task for every file when it is empty. A ValueError names the key and what is wrong."""
    files = parse_named_paths(getattr(data, f"{split}_path"), f"data.{split}_path")
    value = getattr(data, f"{split}_tasks")
    if not value.strip():
        return [data.task] * len(files)
    tasks = [t.strip() for t in value.split(",")]
    if len(tasks) != len(files):
        raise ValueError(f"--config.data.{split}_tasks={value!r} gives {len(tasks)} task(s) for {len(files)} file(s) "
                         f"of data.{split}_path: give one per file, in its order.")
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"--config.data.{split}_tasks={value!r}: {bad[0]!r} is not a task; each is one of "
                         f"{', '.join(TASKS)}.")
    return tasks


OVERRIDABLE = ("question_field", "answer_field", "prompt_template", "system_prompt", "max_prompt_len")


def _parse_overrides(text: str, key: str, names: tuple[str, ...] | None, what: str, unit: str,
                     example: str) -> dict[str, dict]:
    """A JSON object of name -> object of OVERRIDABLE data keys (`key`'s value), checked: each name one of `names`
    (`what` they are; None: any), each key overridable. {} when empty."""
    import json

    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config.data.{key} is not JSON ({e}); write e.g. '{example}'.") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError(f"--config.data.{key} must be a JSON object of {what} -> object of data keys, e.g. "
                         f"'{example}'.")
    for name, keys in value.items():
        if names is not None and name not in names:
            raise ValueError(f"--config.data.{key}: {name!r} is not {what}; each is one of {', '.join(names)}.")
        bad = [k for k in keys if k not in OVERRIDABLE]
        if bad:
            raise ValueError(f"--config.data.{key}: {bad[0]!r} cannot differ per {unit}; the keys that can are "
                             f"{', '.join(OVERRIDABLE)}.")
    return value


def task_overrides(data: Any) -> dict[str, dict]:
    """data.task_overrides as {task: {data key: value}} ({} when empty); a ValueError says what is wrong."""
    return _parse_overrides(data.task_overrides, "task_overrides", TASKS, "a task", "task",
                            '{"code": {"system_prompt": "..."}}')


def file_names(data: Any) -> tuple[str, ...]:
    """The names of data.train_path's and data.test_path's files (NAME of NAME=PATH, else the file's stem)."""
    names = [f.name for split in ("train", "test") for f in parse_named_paths(getattr(data, f"{split}_path"),
                                                                                f"data.{split}_path")]
    return tuple(dict.fromkeys(names))


def file_overrides(data: Any, check_names: bool = True) -> dict[str, dict]:
    """data.file_overrides as {file name: {data key: value}} ({} when empty); a ValueError says what is wrong (with
    check_names, also a name that is not one of data.train_path's or data.test_path's files)."""
    return _parse_overrides(data.file_overrides, "file_overrides", file_names(data) if check_names else None,
                            "a file name of data.train_path or data.test_path", "file",
                            '{"math500": {"max_prompt_len": 512}}')


def for_task(data: Any, task: str) -> Any:
    """The data section as ``task``'s files read it: data.task_overrides[task] applied, the task set."""
    try:
        return data.replace(task=task, task_overrides="", file_overrides="", **task_overrides(data).get(task, {}))
    except Exception as e:  # a value of the wrong type or range: the section's own check, named for this key
        raise ValueError(f"--config.data.task_overrides[{task!r}]: {e}") from None


def for_file(data: Any, task: str, name: str | None) -> Any:
    """The data section as the file ``name`` (of ``task``) is read: data.task_overrides[task], then
    data.file_overrides[name] applied."""
    keys = file_overrides(data, check_names=False).get(name, {}) if name is not None else {}
    section = for_task(data, task)
    try:
        return section.replace(**keys) if keys else section
    except Exception as e:
        raise ValueError(f"--config.data.file_overrides[{name!r}]: {e}") from None


def files_as_read(data: Any) -> list[tuple[str, Any]]:
    """(where, data section) for every way the run reads a file: the data section itself, each task of
    data.task_overrides, and each file of data.file_overrides (with its task's overrides under it); `where` names
    the section's source in an error ("data", "data.task_overrides['code']", "data.file_overrides['x']").
    A ValueError says what is wrong in either override."""
    out = [("data", data)]
    out += [(f"data.task_overrides[{t!r}]", for_task(data, t)) for t in task_overrides(data)]
    named = file_overrides(data)
    for split in ("train", "test"):
        files = parse_named_paths(getattr(data, f"{split}_path"), f"data.{split}_path")
        for f, task in zip(files, file_tasks(data, split)):
            if f.name in named:
                out.append((f"data.file_overrides[{f.name!r}]", for_file(data, task, f.name)))
    return out


def load_file(data: Any, path: str, task: str, tokenizer: Any, name: str | None = None) -> Any:
    """One file's prompts (data.pipeline.PromptSource) read as ``task`` and formatted as ``data`` (the config's data
    section) says, with data.task_overrides for that task and data.file_overrides for the file ``name``: field
    names, prompt and chat templates, system prompt, length limit, bad-row policy."""
    from areal_jax.data.pipeline import load_prompt_source

    data = for_file(data, task, name)
    return load_prompt_source(
        expand_files(path), tokenizer, question_field=data.question_field, answer_field=data.answer_field,
        prompt_template=data.prompt_template, use_chat_template=data.use_chat_template,
        system_prompt=data.system_prompt, max_prompt_len=data.max_prompt_len, on_bad_row=data.on_bad_row, task=task)


def load_train_prompts(data: Any, tokenizer: Any, *, seed: int, process_index: int, process_count: int,
                       on_file: Callable[[str], Any]) -> Any:
    """The job's training stream (data.pipeline.PromptIterator) over every file of data.train_path, formatted as
    ``data`` (the config's data section) says, mixed by data.train_weights. on_file(path): a context manager that
    names the file in a read error (system.user_errors.data_file)."""
    from areal_jax.data.pipeline import PromptIterator

    files = parse_named_paths(data.train_path, "data.train_path")
    sources = []
    for f, task in zip(files, file_tasks(data, "train")):
        with on_file(f.path):
            source = load_file(data, f.path, task, tokenizer, f.name)
        if len(files) > 1:  # "<name>:<row>" (of several shards "<name>:<shard>:<row>"): files stay apart by name
            shards = len(expand_files(f.path)) > 1
            source.items = [dataclasses.replace(i, key=_mixture_key(f.name, i.key, shards)) for i in source.items]
        sources.append(source)
    return PromptIterator(sources, seed=seed, shuffle=data.shuffle, process_index=process_index,
                          process_count=process_count, weights=parse_weights(data.train_weights, len(files)))


def _mixture_key(name: str, key: str, shards: bool) -> str:
    """A mixture's task key of an item keyed "<file name>:<row>" in the file named ``name`` of data.train_path."""
    base, row = key.rsplit(":", 1)
    return f"{name}:{os.path.splitext(base)[0]}:{row}" if shards else f"{name}:{row}"


def source_names(data: Any) -> list[str]:
    """The names of data.train_path's files when there are several (their uids start with them), else []."""
    files = parse_named_paths(data.train_path, "data.train_path")
    return [f.name for f in files] if len(files) > 1 else []


def source_summary(groups: Sequence[Any], names: Sequence[str]) -> dict[str, float]:
    """Per training source of a batch's groups (by uid "<name>:<row>:<epoch>"): mean reward, accuracy (share of
    samples scoring 1) and number of groups, as ``source/<name>/...``; a source absent from the batch logs 0 groups
    only."""
    out: dict[str, float] = {}
    for name in names:
        mine = [g for g in groups if g.example.uid.split(":", 1)[0] == name]
        out[f"source/{name}/groups"] = float(len(mine))
        if mine:
            rewards = np.concatenate([np.asarray(g.rewards, np.float64) for g in mine])
            out[f"source/{name}/reward"] = float(rewards.mean())
            out[f"source/{name}/accuracy"] = float(np.mean(rewards >= 1.0))
    return out
