"""Entry point: `python -m areal_jax.main --config=configs/math.py [--config.train.lr=3e-5 ...]`.

The config is validated before JAX initialises a device or compiles anything; a mistake ends the run
with one sentence saying what to change (exit code 2).
"""
from __future__ import annotations

import os
import sys
import traceback

from absl import app
from ml_collections import config_flags

_CONFIG = None  # the --config flag, defined only when this module runs as the program (see the bottom)


def format_summary(summary: dict) -> str:
    """The end-of-run table: accuracy before / after, reward curve, throughput, staleness."""
    ev = summary.get("evaluations", {})
    rows = []

    def acc(tag, key):
        v = ev.get(tag, {}).get(key)
        return "-" if v is None else f"{100 * v:.1f}%"

    rows.append(("test greedy pass@1", acc("start", "greedy_pass@1"), acc("end", "greedy_pass@1")))
    rows.append(("test sampled pass@1", acc("start", "sampled_pass@1"), acc("end", "sampled_pass@1")))

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


def run(config) -> dict:
    """Validate, initialise the runtime, run the job; returns its summary."""
    from areal_jax import config as config_lib

    config_lib.validate(config)
    from areal_jax.system import distributed

    info = distributed.initialize(config)
    import jax

    enable_compilation_cache()

    from areal_jax.system.job import RLJob

    watchdog = None
    if jax.process_count() > 1 and config.distributed.file_heartbeats:
        from areal_jax import paths

        watchdog = distributed.PeerWatchdog(
            os.path.join(paths.local_path(config.run_dir), "heartbeats"), jax.process_index(), jax.process_count(),
            timeout_s=config.distributed.heartbeat_timeout_s,
        ).start()
    job = RLJob(config)
    try:
        summary = job.run()
    except BaseException as e:
        if jax.process_count() > 1:
            # A peer died or a collective failed. Normal interpreter exit would run jax.distributed's
            # shutdown and other exit handlers that wait for the dead peer forever: leave now.
            # (Reward workers exit by themselves when their pipe to this process closes.)
            traceback.print_exc()
            if isinstance(e, Exception):  # not Ctrl-C: let the coordination service name a dead peer
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

    try:
        run(_CONFIG.value)
    except ConfigError as e:
        print(f"Config error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from areal_jax.config import ConfigError, check_override_flags

    try:
        check_override_flags(sys.argv[1:])
    except ConfigError as e:
        print(f"Config error: {e}", file=sys.stderr)
        sys.exit(2)
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/math.py", "Path to a config file (ml_collections).")
    app.run(main)
