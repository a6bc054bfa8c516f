"""Several evaluation sets in one evaluation: ``data.test_path`` may name more than one file.

    --config.data.test_path=gsm8k=/data/gsm8k/test.jsonl,math500=/data/math500/test.jsonl

Each comma-separated item is ``NAME=PATH`` or a bare ``PATH`` (named by its file's stem; areal_jax.data.sources). ``eval.n_test`` takes the
first n problems of each set. All sets' sequences go through one sampler pass (the slots stay full across sets); the
figures of the pass (greedy_pass@1, sampled_pass@1, pass@k, and the repair ones) are those of all problems pooled,
and with more than one set ``sets`` holds each set's own, computed from its problems' records. Each record of an
evaluation's records file then names its set ("set"). The sets share the job's prompt formatting (but for
data.file_overrides) and reward; eval.set_max_new_tokens gives a set a completion budget of its own.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from areal_jax.data.sources import NamedPath, parse_named_paths

EvalSet = NamedPath  # (name, path) of one evaluation set


def parse_eval_sets(test_path: str, key: str = "data.test_path") -> list[NamedPath]:
    """The sets of ``test_path`` ("" -> none); a ValueError says what is wrong (data.sources.parse_named_paths)."""
    return parse_named_paths(test_path, key)


def load_eval_sets(test_path: str, tokenizer: Any, data_config: Any, n: int,
                   on_file: Callable[[str], Any] | None = None) -> dict[str, list]:
    """{set name: its first n prompts, formatted like training} for every set of ``test_path``, in order. on_file:
    a context manager maker given the file read (e.g. system.user_errors.data_file), to name it in a read error.
    With several sets, uids start with the set's name ("<name>:<row>:0", of shards "<name>:<shard>:<row>:0", as a
    training mixture's), so sets whose files share a name stay apart."""
    import contextlib
    import dataclasses

    from areal_jax.data.sources import _mixture_key, expand_files, file_tasks, for_file
    from areal_jax.evaluation.scoring import load_eval_examples

    sets = parse_eval_sets(test_path)
    tasks = file_tasks(dataclasses.replace(data_config, test_path=test_path), "test")
    out = {}
    for s, task in zip(sets, tasks):  # each set read as its task (data.test_tasks)
        with (on_file(s.path) if on_file is not None else contextlib.nullcontext()):
            out[s.name] = load_eval_examples(expand_files(s.path), tokenizer, for_file(data_config, task, s.name), n)
        if len(sets) > 1:
            shards = len(expand_files(s.path)) > 1
            out[s.name] = [dataclasses.replace(e, uid=_mixture_key(s.name, e.uid.rsplit(":", 1)[0], shards) + ":0")
                           for e in out[s.name]]
    return out


def parse_set_budgets(text: str, names: Sequence[str], key: str = "eval.set_max_new_tokens") -> dict[str, int]:
    """``NAME=N,...`` -> {set name: completion budget}; a ValueError names a set that is not one of ``names`` or a
    budget that is not a positive integer."""
    out: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise ValueError(f"--config.{key}={text!r}: {item!r} must be NAME=N with NAME one of the evaluation sets "
                             f"({', '.join(names) or 'none: data.test_path is empty'}).")
        try:
            out[name] = int(value)
        except ValueError:
            out[name] = 0
        if out[name] < 1:
            raise ValueError(f"--config.{key}={text!r}: {name}'s budget {value.strip()!r} must be a positive integer.")
    return out


def example_budgets(sets: Mapping[str, Sequence[Any]], eval_config: Any) -> list[int]:
    """Each example's completion budget, in `flatten` order: its set's from eval.set_max_new_tokens, else
    eval.max_new_tokens."""
    own = parse_set_budgets(eval_config.set_max_new_tokens, list(sets))
    return [own.get(name, eval_config.max_new_tokens) for name, examples in sets.items() for _ in examples]


def flatten(sets: Mapping[str, Sequence[Any]]) -> list:
    """Every set's examples, one list in set order (what one sampler pass evaluates)."""
    return [e for examples in sets.values() for e in examples]


def set_figures(problems: Sequence[Mapping[str, Any]], k: int) -> dict:
    """greedy_pass@1 (and with k > 0 sampled_pass@1, pass@k) of problem records (evaluation.scoring.problem_records),
    with a repair evaluation's first-attempt figures as the plain ones and its last attempts' as repair_*, as
    evaluate_examples reports them for the whole pass."""
    from areal_jax.evaluation.scoring import pass_at_k

    def figures(greedy: Sequence[float], correct: Sequence[int]) -> dict:
        out = {"greedy_pass@1": float(np.mean(np.asarray(greedy) >= 1.0)) if len(greedy) else 0.0}
        if k > 0:
            out["sampled_pass@1"] = float(np.mean(np.asarray(correct) / k)) if len(correct) else 0.0
            out[f"pass@{k}"] = float(np.mean([pass_at_k(k, int(c), k) for c in correct])) if len(correct) else 0.0
        return out

    out: dict[str, Any] = {"n": len(problems)}
    repair = any("greedy_first_reward" in p for p in problems)
    if repair:
        out.update(figures([p["greedy_first_reward"] for p in problems], [p["correct_first"] for p in problems]))
        out.update({f"repair_{name}": v for name, v in figures([p["greedy_reward"] for p in problems],
                                                               [p["correct"] for p in problems]).items()})
    else:
        out.update(figures([p["greedy_reward"] for p in problems], [p["correct"] for p in problems]))
    return out


def evaluate_sets(sets: Mapping[str, Sequence[Any]], evaluate: Callable[[list], dict], k: int) -> dict:
    """One evaluation of every set: ``evaluate`` (given all examples in set order, returning evaluate_examples' dict
    with "problems") runs once; with more than one set, each problem record gets its "set" and the result a "sets"
    entry, {name: set_figures of its problems}."""
    res = evaluate(flatten(sets))
    if len(sets) > 1:
        problems, start, per_set = res["problems"], 0, {}
        for name, examples in sets.items():
            mine = problems[start:start + len(examples)]
            start += len(examples)
            for p in mine:
                p["set"] = name
            per_set[name] = set_figures(mine, k)
        res["sets"] = per_set
    return res


def set_lines(res: Mapping[str, Any]) -> list[str]:
    """One line per set of a multi-set evaluation: "name: greedy pass@1 0.550 on 200 problems" (+ sampled, repair)."""
    lines = []
    for name, f in (res.get("sets") or {}).items():
        line = f"{name}: greedy pass@1 {f['greedy_pass@1']:.3f}"
        if "sampled_pass@1" in f:
            line += f", sampled pass@1 {f['sampled_pass@1']:.3f}"
        if "repair_greedy_pass@1" in f:
            line += f", after repair turns {f['repair_greedy_pass@1']:.3f}"
        lines.append(f"{line} on {f['n']} problems")
    return lines


def metric_items(res: Mapping[str, Any]) -> dict[str, float]:
    """The evaluation's numbers as metrics: eval/<figure> for the pass, eval/<set>/<figure> for each set."""
    out = {f"eval/{k}": v for k, v in res.items() if isinstance(v, float)}
    for name, f in (res.get("sets") or {}).items():
        out.update({f"eval/{name}/{k}": float(v) for k, v in f.items() if isinstance(v, (int, float))})
    return out
