"""Checkpoint saves written in the background (checkpoint.async_save) against saves the trainer waits for.

The trainer of a preset (random weights, float32 params and AdamW moments: the state a run checkpoints) runs
`--updates` real `Trainer.update` calls on a small batch and saves the state every `--every` updates, into a
fresh directory; each mode runs twice (--rounds), alternated, each run in a process of its own on the same device.
Printed per run: the time each save held the trainer, the time each took to be complete on disk, the loop's
wall time and the process's peak resident memory; then the ratios. On a CPU the background write shares the
cores with the updates, so the loop gains less than the held time does; on an accelerator host the write
runs on host cores the device's work does not need.

An asynchronous save costs host memory: the state it writes stays in memory until written, beside the state
the updates go on with (on a CPU both are in the same memory). Where the host lacks it, the checkpointer writes
that save before training goes on; the runs count those saves. On a 24 GiB machine the 0.5B preset's 5.5 GiB
state is saved that way; `--layers 8` keeps its widths and vocabulary at half the state.

    python benchmarks/checkpoint.py                                       # tiny preset, seconds
    python benchmarks/checkpoint.py --preset qwen2.5-0.5b --layers 8      # a 2.9 GiB state

The last line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import matmul_peak_gflops  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.checkpoint import Checkpointer  # noqa: E402
from areal_jax.models import Transformer  # noqa: E402
from areal_jax.runtime.mesh import MeshConfig, build_meshes  # noqa: E402
from areal_jax.system import loadgen  # noqa: E402
from areal_jax.system.params import tree_nbytes  # noqa: E402
from areal_jax.trainer import Trainer, TrainerConfig  # noqa: E402
from areal_jax.trainer.batch import Trajectory  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(loadgen.PRESETS), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="the preset with this many decoder layers")
    p.add_argument("--updates", type=int, default=6, help="timed updates per mode")
    p.add_argument("--every", type=int, default=2, help="save after every this many updates")
    p.add_argument("--seqs", type=int, default=4, help="trajectories per update")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per trajectory (half prompt)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternated (sync, async, sync, ...)")
    p.add_argument("--mode", choices=("sync", "async"), help=argparse.SUPPRESS)  # one run, in this process
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: each mode must run at least once")
    return args


def batch(vocab: int, n: int, length: int, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    prompt = length // 2
    return [Trajectory(tokens=rng.integers(3, vocab, length), prompt_len=prompt,
                       behav_logp=np.full(length - prompt, -2.0, np.float32),
                       versions=np.zeros(length - prompt, np.int32), advantage=float(rng.normal()))
            for _ in range(n)]


def run_mode(trainer: Trainer, trajs, args, directory: str, async_save: bool) -> dict:
    """`args.updates` updates with a save every `args.every`, the last save waited for; its figures."""
    shutil.rmtree(directory, ignore_errors=True)
    written = []
    ck = Checkpointer(directory, keep=2, async_save=async_save, on_written=lambda s, t: written.append(t))
    held = []
    t0 = time.perf_counter()
    for i in range(1, args.updates + 1):
        trainer.update(trajs)
        if i % args.every == 0:
            ck.save(trainer.version, trainer.state, {"version": trainer.version})
            held.append(ck.last_blocked_s)
    t_wait = time.perf_counter()
    ck.wait()  # the run's end waits for the last write
    wall = time.perf_counter() - t0
    steps = ck.all_steps()
    ck.close()
    return {"wall_s": wall, "held_s": held, "write_s": written, "final_wait_s": wall - (t_wait - t0),
            "steps_on_disk": steps, "blocking_fallbacks": ck.blocking_fallbacks}


def one_run(args) -> dict:
    """One mode in this process: build the trainer, compile, time the loop."""
    dev = jax.devices()[0]
    cfg = loadgen.model_config(args.preset, args.seq_len, "float32")
    if args.layers:
        cfg = cfg.with_layers(args.layers)
    meshes = build_meshes(MeshConfig(), devices=[dev])
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tcfg = TrainerConfig(micro_batch_tokens=max(args.seq_len * args.seqs, 256), warm_up=False,
                         scan_layers=args.preset != "tiny", logits_chunk=256)
    trainer = Trainer(model, tcfg, meshes.train_mesh)
    del model
    trajs = batch(cfg.vocab_size, args.seqs, args.seq_len, 0)
    t = time.perf_counter()
    trainer.update(trajs)  # compile
    compile_s = time.perf_counter() - t
    root = args.dir or tempfile.mkdtemp(prefix="areal_jax-ckpt-bench-")
    # A save before timing: orbax's first save in a process sets itself up (about half a second).
    first_dir = os.path.join(root, "first")
    shutil.rmtree(first_dir, ignore_errors=True)
    first = Checkpointer(first_dir, async_save=False)
    first.save(0, trainer.state, {})
    first.close()
    t = time.perf_counter()
    for _ in range(args.every):
        trainer.update(trajs)
    update_s = (time.perf_counter() - t) / args.every
    r = run_mode(trainer, trajs, args, os.path.join(root, args.mode), args.mode == "async")
    for d in ([root] if not args.dir else [first_dir, os.path.join(root, args.mode)]):
        shutil.rmtree(d, ignore_errors=True)
    r.update(mode=args.mode, compile_s=compile_s, update_s=update_s, state_bytes=tree_nbytes(trainer.state),
             params=sum(x.size for x in jax.tree.leaves(trainer.params)), device=dev.device_kind,
             backend=jax.default_backend(), peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return r


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.mode:
        print(json.dumps(one_run(args)))
        return {}
    peak = matmul_peak_gflops()
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    results, order = {}, ("sync", "async") * args.rounds
    for i, mode in enumerate(order):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *forwarded, "--mode", mode],
                              capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout)[-1500:]
            killed = " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
            print(f"{mode} run {i}: exit {proc.returncode}{killed}\n{tail}", flush=True)
            results[f"{mode}{i}"] = {"mode": mode, "failed": proc.returncode}
            continue
        r = json.loads(lines[-1])
        results[f"{mode}{i}"] = r
        if i == 0:
            print(f"{args.preset}{f' with {args.layers} layers' if args.layers else ''}: {r['params'] / 1e6:.1f}M "
                  f"params, train state {r['state_bytes'] / 2**30:.2f} GiB (float32 params + AdamW), on "
                  f"{r['device']} ({r['backend']}), float32 matmul peak {peak:.0f} GFLOP/s; update compiled in "
                  f"{r['compile_s']:.1f} s, one update {r['update_s']:.2f} s", flush=True)
        print(f"{mode:5s} loop {r['wall_s']:7.2f} s | trainer held per save "
              f"{', '.join(f'{h:.3f}' for h in r['held_s'])} s | written in "
              f"{', '.join(f'{w:.2f}' for w in r['write_s'])} s | last write waited {r['final_wait_s']:.2f} s | "
              f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB"
              + (f" | {r['blocking_fallbacks']} saves blocked for want of host memory" if r["blocking_fallbacks"]
                 else ""), flush=True)

    def runs(mode):
        return [r for r in results.values() if r["mode"] == mode and "failed" not in r]

    def mean(values):
        return float(np.mean(values)) if values else None

    out = {"bench": "checkpoint", "preset": args.preset, "layers": args.layers, "matmul_peak_gflops": peak,
           "every": args.every, "updates": args.updates, "runs": results}
    for mode in ("sync", "async"):
        rs = runs(mode)
        out[f"held_{mode}_s"] = mean([h for r in rs for h in r["held_s"]])
        out[f"write_{mode}_s"] = mean([w for r in rs for w in r["write_s"]])
        out[f"loop_{mode}_s"] = mean([r["wall_s"] for r in rs])
        out[f"to_last_save_{mode}_s"] = mean([r["wall_s"] - r["final_wait_s"] for r in rs])
        out[f"peak_rss_{mode}_bytes"] = max([r["peak_rss_bytes"] for r in rs], default=None)
    ok = all(out[k] is not None for k in ("held_sync_s", "held_async_s"))
    if ok:
        any_run = runs("sync")[0]
        out.update(device=any_run["device"], backend=any_run["backend"], state_bytes=any_run["state_bytes"],
                   held_ratio=out["held_sync_s"] / max(out["held_async_s"], 1e-9),
                   loop_ratio=out["loop_sync_s"] / max(out["loop_async_s"], 1e-9),
                   to_last_save_ratio=out["to_last_save_sync_s"] / max(out["to_last_save_async_s"], 1e-9))
        print(f"\n{out['device']} ({out['backend']}), {out['state_bytes'] / 2**30:.2f} GiB state, a save every "
              f"{args.every} updates, each mode twice in its own process:")
        print(f"  trainer held per save: sync {out['held_sync_s']:.3f} s, async {out['held_async_s']:.3f} s "
              f"({out['held_ratio']:.1f}x less); written in {out['write_sync_s']:.2f} s (sync) / "
              f"{out['write_async_s']:.2f} s (async, beside the updates)")
        print(f"  loop of {args.updates} updates + {args.updates // args.every} saves: sync {out['loop_sync_s']:.2f} s, "
              f"async {out['loop_async_s']:.2f} s ({out['loop_ratio']:.2f}x); peak RSS sync "
              f"{out['peak_rss_sync_bytes'] / 2**30:.2f} GiB, async {out['peak_rss_async_bytes'] / 2**30:.2f} GiB")
        print(f"  the same loop until the last save returns (a job's end evaluation runs beside the last write): "
              f"sync {out['to_last_save_sync_s']:.2f} s, async {out['to_last_save_async_s']:.2f} s "
              f"({out['to_last_save_ratio']:.2f}x)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
