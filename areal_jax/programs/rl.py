"""The RL job program, run as `python -m areal_jax.main --config=configs/math.py [--config.train.lr=3e-5 ...]`.

The config is validated before JAX initialises a device or compiles anything; a mistake ends the run
with one sentence saying what to change (exit code 2). `--help` shows the most-used keys,
`--config.help` every key with its default and doc (from the fields of the config sections, areal_jax.config).
"""
from __future__ import annotations

import os
import sys
import traceback

from absl import app
from ml_collections import ConfigDict, config_flags

_CONFIG = None  # the --config flag, defined only when the program runs (cli())
_NONE_KEYS: list[str] = []  # keys the command line sets to None (config.split_none_overrides)

# The keys a user changes first, shown by --help (their docs come from config.config_docs()).
MOST_USED_KEYS = ("run_dir", "total_steps", "model.path", "data.train_path", "data.test_path", "train.lr",
                  "train.batch_groups", "rollout.group_size", "rollout.max_staleness", "eval.n_test")


def help_text() -> str:
    """What `python -m areal_jax.main --help` prints."""
    from areal_jax.config import config_docs

    docs = config_docs()
    keys = "\n".join(f"  --config.{k:<24} {docs.get(k, '')}" for k in MOST_USED_KEYS)
    return f"""usage: python -m areal_jax.main --config=CONFIG_FILE [--config.KEY=VALUE ...]

Runs asynchronous RL (rollout and training at the same time, staleness bounded by eta) until
total_steps, then prints a before / after table. Results go to run_dir (metrics.jsonl, summary.json,
timeline.json, samples.jsonl, evaluations/<tag>.jsonl, checkpoints); running the same command again resumes
from the last checkpoint.

CONFIG_FILE is a Python file whose get_config() returns an ml_collections ConfigDict that starts from
areal_jax.config.base_config() and overrides some keys: configs/math.py (the default: a small math
reasoner on CPU), configs/gsm8k_qwen.py (Qwen2.5 on GSM8K, GPU / TPU), configs/tiny.py (smoke test).
Any key can be overridden on the command line, e.g. --config.rollout.max_staleness=0 (synchronous RL).

Most-used keys:
{keys}

  --config.help                  every key with its default and what it means
  --verbosity=0                  libraries' INFO logs on the console
  --helpfull                     every command-line flag (absl)
"""


def _eval_row(summary: dict, loop_tokens_per_s: float | None) -> str | None:
    """Evaluation cost line: seconds, share of the job's wall time, tokens/s against the loop's."""
    ev = [e for e in summary.get("evaluations", {}).values() if isinstance(e, dict) and "seconds" in e]
    if not ev or summary.get("eval_s") is None:
        return None
    tps = sum(e.get("generated_tokens", 0) for e in ev) / max(sum(e.get("generate_s", 0.0) for e in ev), 1e-9)
    loop = "-" if loop_tokens_per_s is None else f"{loop_tokens_per_s:,.0f}"
    return (f"evaluation {summary['eval_s']:.0f} s ({100 * summary.get('eval_share', 0.0):.0f}% of "
            f"{summary.get('job_wall_s', 0.0):.0f} s), {tps:,.0f} generated tokens/s (loop: {loop})")


def format_summary(summary: dict) -> str:
    """The end-of-run table: accuracy before / after, reward curve, throughput, staleness."""
    ev = summary.get("evaluations", {})
    rows = []

    def acc(tag, key):
        v = ev.get(tag, {}).get(key)
        return "-" if v is None else f"{100 * v:.1f}%"

    rows.append(("test greedy pass@1", acc("start", "greedy_pass@1"), acc("end", "greedy_pass@1")))
    rows.append(("test sampled pass@1", acc("start", "sampled_pass@1"), acc("end", "sampled_pass@1")))
    names = list(dict.fromkeys(n for e in ev.values() if isinstance(e, dict) for n in e.get("sets") or {}))
    for name in names:  # several evaluation sets: the rows above pool them, these are each set's

        def set_acc(tag, key, name=name):
            v = ev.get(tag, {}).get("sets", {}).get(name, {}).get(key)
            return "-" if v is None else f"{100 * v:.1f}%"
        rows.append((f"  {name}: greedy pass@1", set_acc("start", "greedy_pass@1"), set_acc("end", "greedy_pass@1")))
    if any("repair_greedy_pass@1" in e for e in ev.values()):
        rows.append(("  after repair turns, greedy", acc("start", "repair_greedy_pass@1"),
                     acc("end", "repair_greedy_pass@1")))
        rows.append(("  after repair turns, sampled", acc("start", "repair_sampled_pass@1"),
                     acc("end", "repair_sampled_pass@1")))

    def num(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    rows.append(("train reward (first / last quarter)", num(summary.get("reward_first_quarter")),
                 num(summary.get("reward_last_quarter"))))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'before':>10}  {'after':>10}"]
    lines += [f"{name:<{width}}  {a:>10}  {b:>10}" for name, a, b in rows]
    lines.append(f"steps {summary['steps']}, wall {summary['wall_s']:.0f} s, generated tokens/s "
                 f"{num(summary.get('tokens_per_s'), '{:.0f}')}, trained tokens/s "
                 f"{num(summary.get('trained_tokens_per_s'), '{:.0f}')}, sampler occupancy "
                 f"{num(summary.get('sampler_occupancy'), '{:.2f}')}, staleness mean "
                 f"{num(summary.get('staleness_mean'), '{:.2f}')} / max {num(summary.get('staleness_max'), '{:.0f}')}")
    row = _eval_row(summary, summary.get("tokens_per_s"))
    if row:
        lines.append(row)
    retired = summary.get("retired_tasks") or {}
    if retired.get("retired_solved") or retired.get("retired_unsolved") or retired.get("retirement_resets"):
        lines.append(f"tasks retired (rollout.retire_solved / retire_unsolved): {retired['retired_solved']} solved, "
                     f"{retired['retired_unsolved']} unsolved; retirement started over "
                     f"{retired['retirement_resets']} times")
    if summary.get("checkpoint_write_s"):
        lines.append(f"checkpoints: written in {summary['checkpoint_write_s']:.1f} s, of which the trainer waited "
                     f"{summary.get('checkpoint_blocked_s', 0.0):.1f} s")
    if summary.get("matmul_peak_gflops"):
        lines.append(f"machine: float32 matmul peak {summary['matmul_peak_gflops']:.0f} GFLOP/s (measured at start)")
    return "\n".join(lines)


def enable_compilation_cache(path: str | None = None) -> None:
    """Persist compiled XLA programs across runs (a resumed or repeated run skips most compiles).

    Location: `path`, else $AREAL_JAX_COMPILE_CACHE, else ~/.cache/areal_jax/xla; "off" disables it.
    """
    import jax

    path = path or os.environ.get("AREAL_JAX_COMPILE_CACHE") or os.path.expanduser("~/.cache/areal_jax/xla")
    if path == "off":
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def run(config: ConfigDict) -> dict:
    """Validate (the ConfigDict becomes a typed JobConfig), initialise the runtime, run the job; returns
    its summary."""
    from areal_jax import config as config_lib

    config = config_lib.validate(config)
    from areal_jax.runtime import distributed

    info = distributed.initialize(config)
    import jax

    from areal_jax.metrics import matmul_peak_gflops

    enable_compilation_cache()

    from areal_jax.system.job import RLJob

    watchdog = None
    if jax.process_count() > 1 and config.distributed.file_heartbeats:
        from areal_jax import paths

        watchdog = distributed.PeerWatchdog(
            os.path.join(paths.local_path(config.run_dir), "heartbeats"), jax.process_index(), jax.process_count(),
            timeout_s=config.distributed.heartbeat_timeout_s,
        ).start()
    job = RLJob(config)  # every mistake in the config, data, model or run_dir is raised in here
    try:
        # The yardstick for every figure of the run, measured once the inputs are known to be usable (~1-2 s).
        job.machine["matmul_peak_gflops"] = peak = matmul_peak_gflops(repeats=3)
        if jax.process_index() == 0:
            print(f"Machine: {jax.device_count()} {jax.devices()[0].platform.upper()} device(s), float32 matmul "
                  f"peak {peak:.0f} GFLOP/s (a shared or slow machine shows here; compare figures at the same "
                  "peak).", flush=True)
        summary = job.run()
    except BaseException as e:
        if jax.process_count() > 1:
            # A peer died or a collective failed. Normal interpreter exit would run jax.distributed's
            # shutdown and other exit handlers that wait for the dead peer forever: leave now.
            # (Reward workers exit by themselves when their pipe to this process closes.)
            traceback.print_exc()
            if distributed.is_runtime_failure(e):  # a collective failed: let the service name a dead peer
                wait = info["heartbeat_timeout_s"] + 5
                print(f"process {jax.process_index()} failed (above). If a peer died, JAX's coordination "
                      f"service names it within {wait} s and ends this process; otherwise it exits then.",
                      file=sys.stderr, flush=True)
                sys.stdout.flush()
                distributed.await_peer_verdict(wait)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        raise
    finally:
        job.close()
        if watchdog is not None:
            watchdog.finish()
    if jax.process_index() == 0:
        print(format_summary(summary), flush=True)
    del info
    return summary


def quiet_library_logs() -> None:
    """Keep libraries' INFO records (orbax writes about ten per checkpoint) off the console unless a
    verbosity was asked for on the command line (--verbosity=0 or -v 0 brings them back); warnings and
    errors still show. The run's own progress lines are printed, not logged, so they are unaffected."""
    from absl import flags
    from absl import logging as absl_logging

    if "verbosity" in flags.FLAGS and not flags.FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    from areal_jax.config import ConfigError

    quiet_library_logs()

    from areal_jax.config import apply_none_overrides

    try:
        run(apply_none_overrides(_CONFIG.value, _NONE_KEYS))
    except ConfigError as e:
        print(f"Config error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    """The command line: --help / --config.help, unknown override keys, then the job (absl app)."""
    global _CONFIG, _NONE_KEYS
    from areal_jax.config import ConfigError, check_override_flags, config_help, split_none_overrides

    if any(a in ("--help", "-h", "-?") for a in sys.argv[1:]):
        print(help_text())
        sys.exit(0)
    if any(a == "--config.help" or a.startswith("--config.help=") for a in sys.argv[1:]):
        files = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")]
        shown = None
        if files:  # the values of that config file instead of the defaults
            from areal_jax.config import load_config_file

            shown = load_config_file(files[-1])
        print(f"Every config key, its value in {files[-1] if files else 'base_config()'} and what it means:\n"
              + config_help(shown))
        sys.exit(0)
    try:
        check_override_flags(sys.argv[1:])
    except ConfigError as e:
        print(f"Config error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    kept, _NONE_KEYS = split_none_overrides(sys.argv[1:])
    sys.argv[1:] = kept
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/math.py", "Path to a config file (ml_collections).")
    app.run(main)


if __name__ == "__main__":
    cli()
