"""Preview a job's data before running it: every file of data.train_path and data.test_path read, formatted and
tokenized exactly as the job will (its tokenizer and chat template, prompt template, system prompt, task per file,
data.max_prompt_len), without loading the model or starting JAX.

    python -m areal_jax.programs.preview --config=configs/gsm8k_qwen.py [--config.KEY=VALUE ...] [--n=2]

Per file it prints how many prompts are usable, how many rows were skipped (malformed with data.on_bad_row=skip,
or longer than data.max_prompt_len), the prompt lengths in tokens (min / median / 95th percentile / max) and their
room left under rollout.max_len, a training mixture's share of draws (data.train_weights), and the first --n prompts
as the model will read them, each with its reference answer (a programming task: a count of its hidden test cases).
Ends with one JSON line of the figures. A malformed row stops it as it would stop the job: naming file and line.
A run at real sizes takes minutes to load and compile; this takes seconds.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable

import numpy as np

from areal_jax.config import ConfigError, JobConfig


def _answer_text(answer: str, limit: int = 160) -> str:
    """A reference answer for the eye: math as it is (cut at ``limit``), a programming task's tests as counts."""
    from areal_jax.rewards.mixed import is_code_answer

    if is_code_answer(answer):
        from areal_jax.rewards.code_tests import parse_tests

        spec = parse_tests(answer)
        parts = [f"{len(v)} {name}" for name, v in (("stdin cases", spec.stdio), ("call cases", spec.calls),
                                                      ("test programs", spec.programs)) if v]
        return "hidden tests: " + (", ".join(parts) or "none")
    return answer if len(answer) <= limit else answer[:limit] + " ..."


def preview(job: JobConfig, n: int = 2, log: Callable[[str], None] = print) -> dict:
    """Read every data file of ``job`` as its run will and report it (see the module doc); returns the figures."""
    from areal_jax.data.sources import file_tasks, load_file, parse_named_paths, parse_weights
    from areal_jax.system import user_errors
    from areal_jax.tokenizer import Tokenizer

    d, r = job.data, job.rollout
    with user_errors.tokenizer_dir(job.model.path, job.model.tokenizer_path):
        tokenizer = Tokenizer.from_pretrained(job.model.tokenizer_path or job.model.path)
    tokenizer.template_variables.update(d.template_variables)
    out: dict[str, Any] = {"train": [], "test": []}
    for split in ("train", "test"):
        key = f"data.{split}_path"
        files = parse_named_paths(getattr(d, f"{split}_path"), key)
        if split == "test" and not job.eval.enabled:
            files = []
        weights = parse_weights(d.train_weights, len(files)) if split == "train" else None
        shares = [w / sum(weights) for w in weights] if weights else None
        for i, (f, task) in enumerate(zip(files, file_tasks(d, split))):
            with user_errors.data_file(key, f.path):
                source = load_file(d, f.path, task, tokenizer, f.name)
            lengths = np.asarray([len(item.prompt_tokens) for item in source.items])
            entry = {"name": f.name, "path": f.path, "task": task, "prompts": int(len(lengths)),
                     "malformed_skipped": source.num_bad_rows_skipped, "too_long_skipped": source.num_too_long_skipped,
                     "prompt_tokens": {"min": int(lengths.min()), "median": float(np.median(lengths)),
                                       "p95": float(np.percentile(lengths, 95)), "max": int(lengths.max())}}
            if shares:
                entry["share"] = shares[i]
            if split == "test":
                entry["evaluated"] = min(len(lengths), job.eval.n_test)
            out[split].append(entry)
            t = entry["prompt_tokens"]
            mix = f", {100 * shares[i]:.0f}% of draws" if shares else ""
            budget_key, budget = (("rollout.max_new_tokens", r.max_new_tokens) if split == "train"
                                  else ("eval.max_new_tokens", job.eval.max_new_tokens))
            used = f", the first {entry['evaluated']:,} evaluated" if split == "test" else ""
            log(f"{split} {f.name} ({f.path}, {task}{mix}): {entry['prompts']:,} prompts{used}; skipped "
                f"{entry['malformed_skipped']:,} malformed rows and {entry['too_long_skipped']:,} longer than "
                f"data.max_prompt_len={d.max_prompt_len}; prompt tokens min {t['min']} / median {t['median']:.0f} / "
                f"p95 {t['p95']:.0f} / max {t['max']}, leaving {r.max_len - t['max']} of rollout.max_len={r.max_len} "
                f"to the longest prompt's completion ({budget_key}={budget})")
            for item in source.items[:n]:
                log(f"  --- {item.key} ({len(item.prompt_tokens)} tokens):")
                log("  " + tokenizer.decode(list(item.prompt_tokens)).replace("\n", "\n  "))
                log(f"  --- answer: {_answer_text(item.answer)}")
    return out


_CONFIG = None  # --config (a job config file), defined by cli()


def main(argv: list[str]) -> None:
    from absl import app, flags

    from areal_jax.config import from_config_dict, validate
    from areal_jax.programs.rl import quiet_library_logs

    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    quiet_library_logs()
    try:
        if not flags.FLAGS["config"].present:
            raise ConfigError("pass --config=CONFIG_FILE (the job whose data to preview).")
        job = validate(from_config_dict(_CONFIG.value))
        res = preview(job, n=flags.FLAGS.n)
    except ConfigError as e:
        print(f"Config error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(res))


def cli() -> None:
    global _CONFIG
    from absl import app, flags
    from ml_collections import config_flags

    flags.DEFINE_integer("n", 2, "prompts shown per file, as the model will read them.")
    _CONFIG = config_flags.DEFINE_config_file("config", None, "the job's config file (with --config.KEY=VALUE).")
    app.run(main)


if __name__ == "__main__":
    cli()
