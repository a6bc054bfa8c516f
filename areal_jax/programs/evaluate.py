"""Greedy pass@1, sampled pass@1 and pass@k of a policy on a JSONL / Parquet split, math or code.

    python -m areal_jax.programs.evaluate --model=assets/math_reasoner --data=assets/math_reasoner/data/test.jsonl
    python -m areal_jax.programs.evaluate --model=DIR --data=livecodebench.jsonl --task=code --k=8 --out=lcb.jsonl
    python -m areal_jax.programs.evaluate --run_dir=runs/code [--step=N]
    python -m areal_jax.programs.evaluate --config=configs/code.py [--config.KEY=VALUE ...] [--model=DIR]

Where the settings come from, later winning: the defaults of a job's config (areal_jax.config), then a run's
config (`--run_dir`: the run's config.json, and the policy of its latest or `--step` checkpoint, LoRA adapters
folded in) or a config file (`--config`, with `--config.KEY=VALUE` overrides), then the flags given here. So a
run or a config file is evaluated exactly as its job's evaluations were: the same prompt formatting, reward and
reward limits, completion budget, samples and temperature. `--model` is an HF directory (config.json +
safetensors + tokenizer files; `--tensor=N` splits it over N devices, `--replicas=R` decodes with R such engines side
by side); `--task=code` reads programming tasks (APPS / TACO, DeepCoder, LiveCodeBench,
CodeContests, MBPP, HumanEval layouts; areal_jax.data.code_readers) and scores each completion's last ```python block
against the hidden tests in the sandbox (reward.fn=code).

Rewards are scored in worker processes with a time limit, like training rewards, while the sampler still
generates, so a pathological completion costs its own sample, not the evaluation. Progress is printed at each
tenth of the sequences; the end prints pass@1 and pass@j for j = 2, 4, ... up to k, and one JSON line.
`--feedback_turns=N` (code tasks) gives each sequence up to N repair attempts after execution feedback on its
task's first cases, as training's rollout.feedback_turns does, and reports pass@1 of the first and of the last
attempts. `--out=FILE.jsonl` keeps one line per problem (its uid "<file>:<row>:0", question, greedy completion and
reward, the k samples and their rewards). `--data=NAME=PATH,NAME=PATH` evaluates several sets in one pass, printing
each set's figures after those of all of them pooled (each record then names its "set"; areal_jax.evaluation.sets).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from typing import Any

from areal_jax.config import ConfigError, JobConfig

# flag -> (section, field) of the job config it overrides when given
_OVERRIDES = {
    "data": ("data", "test_path"), "task": ("data", "task"), "tasks": ("data", "test_tasks"), "question_field": ("data", "question_field"),
    "answer_field": ("data", "answer_field"), "prompt_template": ("data", "prompt_template"),
    "chat_template": ("data", "use_chat_template"), "system_prompt": ("data", "system_prompt"),
    "chat_template_vars": ("data", "chat_template_vars"),
    "max_prompt_len": ("data", "max_prompt_len"), "on_bad_row": ("data", "on_bad_row"),
    "reward_fn": ("reward", "fn"), "reward_timeout_s": ("reward", "timeout_s"),
    "reward_workers": ("reward", "num_workers"), "code_mode": ("reward", "code_mode"),
    "code_case_timeout_s": ("reward", "code_case_timeout_s"), "code_sample_timeout_s": ("reward", "code_sample_timeout_s"),
    "code_allow_numpy": ("reward", "code_allow_numpy"), "code_output_match": ("reward", "code_output_match"),
    "code_time_limit_factor": ("reward", "code_time_limit_factor"),
    "n": ("eval", "n_test"), "k": ("eval", "samples"), "max_new_tokens": ("eval", "max_new_tokens"),
    "set_max_new_tokens": ("eval", "set_max_new_tokens"),
    "num_slots": ("eval", "num_slots"), "streams": ("eval", "streams"), "decode_steps": ("eval", "decode_steps"),
    "temperature": ("rollout", "temperature"), "model": ("model", "path"), "tokenizer": ("model", "tokenizer_path"),
    "dtype": ("model", "dtype"), "feedback_turns": ("eval", "feedback_turns"),
    "feedback_cases": ("rollout", "feedback_cases"), "feedback_template": ("rollout", "feedback_template"),
}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What one evaluation runs: the job config whose data / reward / eval / model sections apply, the
    sampled completions' top_p, where the policy comes from and where per-problem records go."""

    config: JobConfig
    top_p: float | None = None
    tensor: int = 1
    replicas: int = 1  # engines side by side, each on its own `tensor` devices (-1: as many as the host holds)
    run_dir: str | None = None
    step: int | None = None
    out: str | None = None
    notes: tuple[str, ...] = ()


def resolve_settings(base: JobConfig, given: dict[str, Any], *, top_p: float | None = None, tensor: int = 1,
                     run_dir: str | None = None, step: int | None = None, out: str | None = None,
                     replicas: int = 1) -> EvalSettings:
    """``base`` (defaults, a run's or a config file's) with the flags the user gave (``given``: flag -> value,
    the names of ``_OVERRIDES``). A code task whose reward was left at math scores with the code reward, its
    worker limit raised above the per-sample test limit. ConfigError (naming the flag) on a bad combination."""
    changes: dict[str, dict[str, Any]] = {name: {} for name in ("data", "reward", "eval", "rollout", "model")}
    for flag, value in given.items():
        section, field = _OVERRIDES[flag]
        changes[section][field] = value
    notes = []
    task = changes["data"].get("task", base.data.task)
    fn = changes["reward"].get("fn", base.reward.fn)
    case_s = changes["reward"].get("code_case_timeout_s", base.reward.code_case_timeout_s)
    sample_s = changes["reward"].get("code_sample_timeout_s", base.reward.code_sample_timeout_s)
    tasks = {t.strip() for t in changes["data"].get("test_tasks", base.data.test_tasks).split(",") if t.strip()}
    if task == "code" and fn == "math" and "reward_fn" not in given and tasks <= {"code"}:
        changes["reward"]["fn"] = fn = "code"
        notes.append(f"a code task: rewards by the code sandbox (reward.fn=code), {case_s:g} s per test case, "
                     f"{sample_s:g} s per sample")
    if len(tasks) > 1 and fn == "math" and "reward_fn" not in given:
        changes["reward"]["fn"] = fn = "mixed"
        notes.append(f"math and code sets: each scored by its task's reward (reward.fn=mixed), {case_s:g} s per test "
                     f"case, {sample_s:g} s per sample")
    if fn in ("code", "mixed") and "reward_timeout_s" not in given:  # the worker's limit above the tests' own
        changes["reward"]["timeout_s"] = max(base.reward.timeout_s, sample_s + 5.0)
    if task == "math" and fn == "code":
        raise ConfigError("the reward is the code sandbox (reward.fn=code) but the data is read as math rows; "
                          "pass --task=code.")
    sections = {}
    for name, fields in changes.items():
        try:
            sections[name] = getattr(base, name).replace(**fields)
        except ConfigError as e:
            raise ConfigError(flag_names(str(e))) from None
    data = sections["data"]
    if not data.test_path:
        raise ConfigError("no evaluation data: pass --data=FILE (JSONL or Parquet), or a config / run with "
                          "data.test_path set.")
    from areal_jax.evaluation.sets import parse_eval_sets

    try:
        sets = parse_eval_sets(data.test_path, key="data")
    except ValueError as e:
        raise ConfigError(str(e).replace("--config.data", "--data")) from None
    from areal_jax.data.sources import missing_files

    for s in sets:
        why = missing_files(s.path)
        if why is not None:
            raise ConfigError(f"--data={s.path!r} {why}." if len(sets) == 1 else
                              f"--data: {s.path!r} (the set {s.name!r}) {why}.")
    if run_dir is None and not os.path.isdir(sections["model"].path or ""):
        raise ConfigError(f"--model={sections['model'].path!r} is not a directory: point it at an HF checkpoint "
                          "directory (config.json + model.safetensors + tokenizer files), or pass --run_dir=RUN.")
    if sections["eval"].n_test < 1:
        raise ConfigError(f"--n={sections['eval'].n_test} must be at least 1.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ConfigError(f"--top_p={top_p} must be in (0, 1].")
    if tensor < 1 or (replicas < 1 and replicas != -1):
        raise ConfigError(f"--tensor={tensor} and --replicas={replicas} must be at least 1 (devices the model is split "
                          "over, engines side by side; --replicas=-1: every device of the host).")
    if sections["eval"].samples > 0 and not sections["rollout"].temperature > 0:
        raise ConfigError(f"--temperature={sections['rollout'].temperature} must be > 0 for the k sampled completions "
                          "(--k=0 evaluates greedy pass@1 only).")
    if out:
        from areal_jax import paths

        parent = os.path.dirname(os.path.abspath(out)) if paths.is_local(out) else None
        if parent is not None and not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
            raise ConfigError(f"--out={out!r}: {parent} is not a writable directory.")
    # The job's training-side relations (a rollout slot holds the longest prompt + completion, a micro-batch the
    # longest sequence) say nothing of an evaluation, whose engine is sized from its own prompts: kept true.
    longest = data.max_prompt_len + sections["rollout"].max_new_tokens
    if longest > sections["rollout"].max_len:
        sections["rollout"] = sections["rollout"].replace(max_len=longest)
    if sections["rollout"].max_len > base.train.micro_batch_tokens:
        sections["train"] = base.train.replace(micro_batch_tokens=sections["rollout"].max_len)
    config = dataclasses.replace(base, **sections)
    return EvalSettings(config=config, top_p=top_p, tensor=int(tensor), replicas=int(replicas), run_dir=run_dir,
                        step=step, out=out, notes=tuple(notes))


def flag_names(message: str) -> str:
    """A config error's text with each ``--config.SECTION.FIELD`` this program has a flag for named by that flag."""
    text = " ".join(message.split())
    for flag, (section, field) in _OVERRIDES.items():
        text = re.sub(rf"--config\.{section}\.{field}\b", f"--{flag}", text)
    return text


def pass_at_powers(correct: list[int], k: int) -> dict[str, float]:
    """Mean unbiased pass@j over problems for j = 1, 2, 4, ... < k and j = k, from each problem's count of correct
    samples among k."""
    from areal_jax.evaluation.scoring import pass_at_k

    n = max(len(correct), 1)
    return {f"pass@{j}": sum(pass_at_k(k, c, j) for c in correct) / n for j in _powers(k)} if k > 0 else {}


def evaluate(settings: EvalSettings, log: Any = print) -> dict:
    """Load the policy, evaluate it as ``settings`` say, write the records; returns the results (the JSON line)."""
    import jax

    from areal_jax.evaluation.scoring import evaluate_examples
    from areal_jax.evaluation.sets import evaluate_sets, example_budgets, flatten, load_eval_sets
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.tokenizer import Tokenizer

    c = settings.config
    devices = jax.local_devices()
    replicas = len(devices) // settings.tensor if settings.replicas == -1 else settings.replicas
    if settings.tensor * max(replicas, 1) > len(devices):
        raise ValueError(f"--tensor={settings.tensor} x --replicas={settings.replicas} asks for more devices than this "
                         f"host has ({len(devices)}); lower one of them.")
    mesh = None  # one engine per replica, a whole copy of the weights over its tensor devices
    if settings.tensor * replicas > 1:
        from areal_jax.runtime.mesh import rollout_mesh

        mesh = rollout_mesh(devices, replicas, settings.tensor)
    if settings.run_dir is not None:
        from areal_jax.programs.export import restore_policy

        model, _, step = restore_policy(settings.run_dir, settings.step)
        if c.lora.enabled:
            from areal_jax.models.lora import merged_model

            model = merged_model(model, c.lora.scale, c.model.storage_dtype)
        source = f"{settings.run_dir} (step {step})"
    else:
        model = load_hf_checkpoint(c.model.path, mesh=mesh, param_dtype=c.model.storage_dtype,
                                   dtype=c.model.compute_dtype, max_len=c.rollout.max_len, moe_impl=c.model.moe_impl)
        source = c.model.path
    tokenizer = Tokenizer.from_pretrained(c.model.tokenizer_path or c.model.path)
    tokenizer.template_variables.update(c.data.template_variables)
    sets = load_eval_sets(c.data.test_path, tokenizer, c.data, c.eval.n_test)
    examples, budgets = flatten(sets), example_budgets(sets, c.eval)
    k, backend = c.eval.samples, jax.default_backend()
    temperature = c.rollout.temperature
    where = c.data.test_path if len(sets) == 1 else ", ".join(f"{name} ({len(e)})" for name, e in sets.items())
    log(f"Evaluating {source} on {where}: {len(examples)} {c.data.task} problems, greedy"
        + (f" + {k} samples at temperature {temperature:g}" + (f", top_p {settings.top_p:g}" if settings.top_p else "")
           if k else "") + f", reward {c.reward.fn}, {c.eval.max_new_tokens} new tokens at most"
        + (f" ({c.eval.set_max_new_tokens})." if c.eval.set_max_new_tokens else "."))
    for note in settings.notes:
        log(f"  ({note})")
    repair, turns = None, c.eval.feedback_turns_for(c.rollout.feedback_turns)
    if turns:
        from areal_jax.sampler.turns import FeedbackTurns

        repair = FeedbackTurns.factory(c, tokenizer, turns)
        log(f"  (up to {turns} repair turn(s) per sequence after feedback on {c.rollout.feedback_cases} shown case(s); "
            "pass@1 of first and of last attempts)")
    with c.reward.make_pool() as pool:
        res = evaluate_sets(sets, lambda examples: evaluate_examples(
            model, tokenizer, examples, max_new_tokens=budgets, k=k, temperature=temperature,
            top_p=settings.top_p, num_slots=c.eval.num_slots, seed=c.seed, pool=pool,
            streams=c.eval.streams_for(backend), decode_steps=c.eval.decode_steps_for(c.rollout.decode_steps, backend),
            records=True, log=log, mesh=mesh, repair=repair), k)
    problems = res.pop("problems")
    if repair is None:
        res.update(pass_at_powers([p["correct"] for p in problems], k))
    else:
        res.update(pass_at_powers([p["correct_first"] for p in problems], k))
        res.update({f"repair_{name}": v for name, v in pass_at_powers([p["correct"] for p in problems], k).items()})
    res.update({"feedback_turns": turns, "model": source, "data": c.data.test_path, "task": c.data.task, "k": k,
                "temperature": temperature, "top_p": settings.top_p, "backend": backend, "tensor": settings.tensor,
                "replicas": replicas})
    if settings.out:
        from areal_jax import paths

        paths.write_text(settings.out, "".join(json.dumps(p) + "\n" for p in problems))  # atomic; local or remote
    return res


def summary_line(res: dict) -> str:
    """The result as text: the pass's figures, then with several sets one line per set."""
    from areal_jax.evaluation.sets import set_lines

    k = res.get("k", 0)
    data = res["data"] if not res.get("sets") else f"all {len(res['sets'])} sets"
    line = f"{res['model']} on {data} ({res['n']} problems): greedy pass@1 {res['greedy_pass@1']:.3f}"
    if k:
        line += f", sampled pass@1 {res['sampled_pass@1']:.3f}"
        line += "".join(f", pass@{j} {res[f'pass@{j}']:.3f}" for j in _powers(k) if j > 1)
    if "repair_greedy_pass@1" in res:
        line += (f"; after up to {res['feedback_turns']} repair turn(s): greedy pass@1 "
                 f"{res['repair_greedy_pass@1']:.3f}")
        if k:
            line += f", sampled pass@1 {res['repair_sampled_pass@1']:.3f}"
            line += "".join(f", pass@{j} {res[f'repair_pass@{j}']:.3f}" for j in _powers(k) if j > 1)
        line += f" ({100 * res['repair_share']:.0f}% of sequences got feedback, {100 * res['repair_fixed']:.0f}% fixed)"
    return "\n".join([line] + [f"  {set_line}" for set_line in set_lines(res)])


def _powers(k: int) -> list[int]:
    out, j = [], 1
    while j < k:
        out.append(j)
        j *= 2
    return out + [k]


_CONFIG = None  # --config (a job config file), defined by cli()


def main(argv: list[str]) -> None:
    from absl import app, flags

    from areal_jax.config import from_config_dict
    from areal_jax.programs.export import load_run_config
    from areal_jax.programs.rl import quiet_library_logs

    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    quiet_library_logs()
    f = flags.FLAGS
    try:
        if f.run_dir and f["config"].present:
            raise ConfigError("pass --run_dir (a run, evaluated with its own config) or --config, not both.")
        if f.run_dir:
            try:
                base = load_run_config(f.run_dir)
            except FileNotFoundError as e:
                raise ConfigError(str(e)) from None
        elif f["config"].present:
            base = from_config_dict(_CONFIG.value)
        else:
            base = JobConfig()
        if f.run_dir and (f["model"].present or f["tokenizer"].present):
            raise ConfigError("--run_dir evaluates the run's own checkpoint; drop --model / --tokenizer (or evaluate "
                              "an exported directory with --model alone).")
        if f["seed"].present:
            base = dataclasses.replace(base, seed=f.seed)
        given = {name: f[name].value for name in _OVERRIDES if f[name].present}
        settings = resolve_settings(base, given, top_p=f.top_p, tensor=f.tensor, run_dir=f.run_dir, step=f.step,
                                    out=f.out, replicas=f.replicas)
    except ConfigError as e:
        print(f"Config error: {flag_names(str(e))}", file=sys.stderr)
        sys.exit(2)
    try:
        res = evaluate(settings)
    except (FileNotFoundError, ValueError) as e:  # a missing checkpoint, an unusable data file
        from areal_jax.data.readers import BadRowError

        text = f"{e.problem} Fix the row, or skip such rows with --on_bad_row=skip." if isinstance(
            e, BadRowError) else flag_names(str(e))
        print(f"Error: {text}", file=sys.stderr)
        sys.exit(2)
    print(summary_line(res))
    if settings.out:
        print(f"Per-problem records: {settings.out}")
    print(json.dumps({k: v for k, v in res.items() if k != "sample_greedy"}))


def define_flags() -> None:
    from absl import flags

    d = JobConfig()
    flags.DEFINE_string("model", None, "HF checkpoint directory (default: the config's model.path).")
    flags.DEFINE_string("tokenizer", None, "tokenizer directory (default: the model's).")
    flags.DEFINE_string("run_dir", None, "evaluate this run's checkpoint with the run's own config.")
    flags.DEFINE_integer("step", None, "with --run_dir: the checkpoint step (default: the latest).")
    flags.DEFINE_string("data", None, "JSONL or Parquet split, or several as NAME=PATH,NAME=PATH (scored apart and "
                        "pooled; default: the config's data.test_path).")
    flags.DEFINE_enum("task", d.data.task, ["math", "code"], "math rows (question / answer) or programming tasks.")
    flags.DEFINE_string("tasks", d.data.test_tasks, "with several --data sets: each one's task, e.g. math,code "
                        "(each scored by its task's reward; default: --task for every set).")
    flags.DEFINE_string("question_field", d.data.question_field, "row field holding the question (auto: by layout).")
    flags.DEFINE_string("answer_field", d.data.answer_field, "row field holding the answer (math).")
    flags.DEFINE_string("prompt_template", d.data.prompt_template, "prompt text around {question}.")
    flags.DEFINE_bool("chat_template", d.data.use_chat_template, "wrap prompts in the tokenizer's chat template.")
    flags.DEFINE_string("system_prompt", d.data.system_prompt, "system message of the chat template.")
    flags.DEFINE_string("chat_template_vars", d.data.chat_template_vars, "extra variables of the chat template, a JSON "
                        "object (e.g. '{\"enable_thinking\": false}').")
    flags.DEFINE_integer("max_prompt_len", d.data.max_prompt_len, "longer prompts are skipped.")
    flags.DEFINE_enum("on_bad_row", d.data.on_bad_row, ["error", "skip"], "a malformed row stops (error) or is skipped.")
    flags.DEFINE_string("reward_fn", d.reward.fn, "math | exact | code | module:function.")
    flags.DEFINE_float("reward_timeout_s", d.reward.timeout_s, "wall-clock limit per sample's reward.")
    flags.DEFINE_integer("reward_workers", d.reward.num_workers, "reward worker processes.")
    flags.DEFINE_enum("code_mode", d.reward.code_mode, ["all_pass", "pass_rate"], "code reward: all tests or their share.")
    flags.DEFINE_float("code_case_timeout_s", d.reward.code_case_timeout_s, "code reward: limit per test case.")
    flags.DEFINE_float("code_sample_timeout_s", d.reward.code_sample_timeout_s, "code reward: limit for all cases "
                       "of a sample.")
    flags.DEFINE_bool("code_allow_numpy", d.reward.code_allow_numpy, "code reward: programs may import numpy "
                      "(ctypes stays refused; see docs/sandbox.md).")
    flags.DEFINE_enum("code_output_match", d.reward.code_output_match, ["numbers", "tokens", "lines"],
                      "code reward: how a stdin case's output is compared (numbers: tokens, reals within 1e-6).")
    flags.DEFINE_float("code_time_limit_factor", d.reward.code_time_limit_factor, "code reward: > 0 bounds each case "
                       "of a task that states its contest's time limit by factor x that limit (0: unused).")
    flags.DEFINE_integer("feedback_turns", d.eval.feedback_turns, "code tasks: repair turns per sequence after "
                         "execution feedback on the first cases (-1: the config's rollout.feedback_turns; 0: one turn).")
    flags.DEFINE_integer("feedback_cases", d.rollout.feedback_cases, "repair turns: test cases the feedback runs.")
    flags.DEFINE_string("feedback_template", d.rollout.feedback_template, "repair turns: text around {feedback}, "
                        "or chat (the tokenizer's chat template's frame).")
    flags.DEFINE_integer("n", d.eval.n_test, "problems to evaluate (the first n).")
    flags.DEFINE_integer("k", d.eval.samples, "sampled completions per problem (0: greedy pass@1 only).")
    flags.DEFINE_integer("max_new_tokens", d.eval.max_new_tokens, "completion budget.")
    flags.DEFINE_string("set_max_new_tokens", d.eval.set_max_new_tokens, "sets with a budget of their own: NAME=N,...")
    flags.DEFINE_float("temperature", d.rollout.temperature, "temperature of the sampled completions.")
    flags.DEFINE_float("top_p", None, "nucleus of the sampled completions (default: off).")
    flags.DEFINE_integer("num_slots", d.eval.num_slots, "sampler slots (all greedy and sampled sequences share them).")
    flags.DEFINE_integer("streams", d.eval.streams, "sampler loops side by side sharing the slots (0: 2 on CPU, 1 "
                         "elsewhere).")
    flags.DEFINE_integer("decode_steps", d.eval.decode_steps, "decode steps per dispatch (0: 1 on CPU, else the "
                         "rollout's).")
    flags.DEFINE_enum("dtype", d.model.dtype, ["float32", "bfloat16"], "compute dtype of the model.")
    flags.DEFINE_integer("seed", d.seed, "sampling seed.")
    flags.DEFINE_integer("tensor", 1, "split the model over this many of the host's devices (tensor parallel).")
    flags.DEFINE_integer("replicas", 1, "engines side by side, each on its own --tensor devices with a whole copy of "
                         "the model and --num_slots slots (-1: as many as the host's devices hold).")
    flags.DEFINE_string("out", None, "write one JSON line per problem here.")


def cli() -> None:
    global _CONFIG
    from absl import app
    from ml_collections import config_flags

    define_flags()
    _CONFIG = config_flags.DEFINE_config_file("config", None, "a job config file (its data / reward / eval settings).")
    app.run(main)


if __name__ == "__main__":
    cli()
