"""Weight hand-off at a real model's size and leaf count: the ParamChannel against a raw device copy.

    python benchmarks/handoff.py                          # Qwen2.5-0.5B shape (290 leaves) on this device
    python benchmarks/handoff.py --preset qwen2.5-1.5b
    python benchmarks/handoff.py --preset tiny --sampler-dtype float32
    python benchmarks/handoff.py --host-only             # the 0.5B tree's 290 leaves, each tiny

--host-only keeps the preset's leaves (layers, biases, norms) but shrinks every dimension, so the
copies cost next to nothing and what is left is the host's work per hand-off: the part that does not
shrink with a faster device (on an H200 a raw copy of the 0.5B bf16 weights takes about 0.7 ms).

Both slices on one device (the default single-accelerator job). Random-free: the float32 train
params are zeros of the preset's shapes, laid out on the train mesh. Timed, best of --repeats:

- reshard: `ParamChannel.reshard` of the train params into the sampler's dtype, the copy every
  publish makes (held flat: `FlatParams`);
- publish -> swapped: `ParamChannel.publish` delivering into an idle `SamplerLoop`, until the loop
  decodes with the new version (the channel's copy, the loop's layout check and its swap);
- raw copy: one jitted copy of a single buffer of the bytes the hand-off writes, and of the float32
  source bytes (a float32 -> bf16 hand-off reads the source and writes half of it);
- written by the update (the job's hand-off, trainer.publish): the optimizer step with and without the
  extra output of the sampler's copy (their difference is what writing the copy adds to an update), then
  publish -> swapped of that copy handed over as it is (`owned=True`, no copy on one device); the sum is
  this hand-off's cost, set against the same raw copies (--no-update skips it: it builds a Trainer, params
  + AdamW state + gradients, about 12 GB at the 0.5B shape);
- what holding the params flat saves: rebuilding the copy into an nnx.State (what the channel handed
  over before), and the host time of dispatching a jitted program that takes the params as an
  nnx.State against as FlatParams (every sampler dispatch passes them).

The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import best_seconds, raw_copy_seconds  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.models import Transformer, logical_to_mesh_sharding  # noqa: E402
from areal_jax.runtime.mesh import MeshConfig, build_meshes  # noqa: E402
from areal_jax.sampler import Engine, SamplerLoop  # noqa: E402
from areal_jax.system import loadgen  # noqa: E402
from areal_jax.system.params import ParamChannel, tree_nbytes  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(loadgen.PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--sampler-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the sampler's weight dtype (the train params are float32)")
    p.add_argument("--host-only", action="store_true",
                   help="the preset's layer count with every dimension tiny: times the host's work alone")
    p.add_argument("--repeats", type=int, default=10, help="timed runs of each figure (the best is kept)")
    p.add_argument("--no-update", action="store_true",
                   help="skip the copy written by the update's optimizer step (needs a Trainer of the preset)")
    return p.parse_args(argv)


def train_params(cfg, mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """The preset's graphdef and float32 params (zeros) laid out on `mesh` by the logical axis rules."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, shapes = nnx.split(abstract)
    shardings = logical_to_mesh_sharding(shapes, mesh)
    zeros = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=shardings)
    return graphdef, zeros()


def dispatch_seconds(params, repeats: int) -> float:
    """Host time of one dispatch of a jitted program that takes `params` (and does no work with them)."""
    fn = jax.jit(lambda p, x: x + 1)
    x = jnp.zeros((), jnp.float32)
    fn(params, x).block_until_ready()
    best = float("inf")
    for _ in range(max(repeats, 50)):
        t = time.perf_counter()
        fn(params, x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def swap_seconds(channel, loop, publish, repeats: int) -> float:
    """Best time from `publish(version)` until the loop decodes with that version (the first run, which
    compiles, left out)."""
    times = []
    for _ in range(repeats + 1):
        version = loop.current_version + 1
        t = time.perf_counter()
        publish(version)
        while loop.current_version != version:
            time.sleep(20e-6)
        times.append(time.perf_counter() - t)
    loop.check()
    return min(times[1:])


def update_written(graphdef, params, meshes, channel, loop, dtype, repeats: int) -> dict:
    """The optimizer step with and without writing the sampler's copy, and that copy's owned hand-over."""
    from areal_jax.trainer import Trainer, TrainerConfig
    from areal_jax.trainer.state import put_global, replicated

    trainer = Trainer(nnx.merge(graphdef, params), TrainerConfig(), meshes.train_mesh)
    trainer.keep_sampler_copy(dtype, channel.targets)  # one device: the sampler's layout (as a job does)
    fns, rep = trainer._fns, replicated(meshes.train_mesh)
    grads, sums = fns.zero_grads(trainer.state.trainable()), fns.zero_metrics()  # zero gradients: a finite step
    scalars = put_global((jnp.asarray(1.0, jnp.float32), jnp.asarray(0, jnp.int32)), (rep, rep))

    def step_seconds(fn) -> float:
        best = float("inf")
        for i in range(repeats + 1):
            t = time.perf_counter()
            out = fn(trainer.state, grads, sums, *scalars)
            jax.block_until_ready(out)
            trainer.state = out[0]
            best = best if i == 0 else min(best, time.perf_counter() - t)
            del out
        return best

    apply_s = step_seconds(fns.apply)
    apply_cast = fns.apply_cast(*trainer._copy.step_key)
    apply_cast_s = step_seconds(apply_cast)
    trainer.state, _, copy = apply_cast(trainer.state, grads, sums, *scalars)
    version = trainer.version

    def publish(v):
        trainer._copy.record(version, copy)  # as Trainer.update does after the step that ends an update
        channel.publish(v, trainer.sampler_copy(), owned=True)  # which the job's publish takes

    swap_s = swap_seconds(channel, loop, publish, repeats)
    handed_over = not channel.last_copied
    return {"apply_s": apply_s, "apply_with_copy_s": apply_cast_s, "copy_in_update_s": apply_cast_s - apply_s,
            "owned_publish_to_swap_s": swap_s, "owned_handed_over": handed_over,
            "update_written_handoff_s": apply_cast_s - apply_s + swap_s}


def main(argv=None) -> dict:
    args = parse_args(argv)
    dev = jax.devices()[0]
    dtype = jnp.bfloat16 if args.sampler_dtype == "bfloat16" else jnp.float32
    cfg = loadgen.model_config(args.preset, 64, args.sampler_dtype)
    if args.host_only:
        cfg = dataclasses.replace(cfg, vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=2,
                                  num_kv_heads=1, head_dim=16)
    meshes = build_meshes(MeshConfig(), devices=[dev])
    graphdef, params = train_params(cfg, meshes.train_mesh)
    n_leaves = len(jax.tree.leaves(params))
    print(f"{args.preset}{' (host only: tiny dimensions)' if args.host_only else ''}: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M params in {n_leaves} leaves, "
          f"float32 -> {args.sampler_dtype}, on {dev.device_kind} ({jax.default_backend()})", flush=True)

    channel = ParamChannel.for_model(params, meshes.rollout_mesh, train_mesh=meshes.train_mesh, dtype=dtype)
    reshard_s = best_seconds(lambda: channel.reshard(params), args.repeats)
    written, source = channel.last_bytes, tree_nbytes(params)
    flat = channel.reshard(params)
    as_state_s = best_seconds(lambda: flat.tree(), args.repeats)  # rebuilding the copy into an nnx.State

    engine = Engine(graphdef, num_slots=1, max_len=32, config=cfg, mesh=meshes.rollout_mesh)
    fused = {}
    with SamplerLoop(engine, flat, version=0) as loop:
        channel.deliver = loop.update_params
        swap_s = swap_seconds(channel, loop, lambda v: channel.publish(v, params), args.repeats)
        if not args.no_update:
            fused = update_written(graphdef, params, meshes, channel, loop, dtype, args.repeats)

    raw_s = raw_copy_seconds(written, dev, dev, args.repeats)
    raw_source_s = raw_copy_seconds(source, dev, dev, args.repeats) if source != written else raw_s
    state_dispatch_s = dispatch_seconds(flat.tree(), args.repeats)
    flat_dispatch_s = dispatch_seconds(flat, args.repeats)

    ms = lambda s: f"{1e3 * s:.2f} ms"  # noqa: E731
    print(f"reshard (the hand-off's copy): {ms(reshard_s)}, {written / 1e6:.1f} MB written "
          f"({written / reshard_s / 1e9:.1f} GB/s)")
    print(f"publish -> swapped in an idle SamplerLoop: {ms(swap_s)}")
    print(f"raw copy of the same {written / 1e6:.1f} MB: {ms(raw_s)} -> hand-off / raw copy "
          f"{reshard_s / raw_s:.2f}x (publish -> swapped {swap_s / raw_s:.2f}x)")
    print(f"raw copy of the float32 source ({source / 1e6:.1f} MB): {ms(raw_source_s)} -> "
          f"{reshard_s / raw_source_s:.2f}x (publish -> swapped {swap_s / raw_source_s:.2f}x)")
    print(f"held flat instead of as an nnx.State: rebuilding the State costs {ms(as_state_s)} a hand-off; "
          f"a dispatch taking the params {ms(state_dispatch_s)} as an nnx.State against "
          f"{ms(flat_dispatch_s)} as FlatParams ({state_dispatch_s / flat_dispatch_s:.1f}x)")
    if fused:
        total = fused["update_written_handoff_s"]
        print(f"written by the update: optimizer step {ms(fused['apply_s'])} -> {ms(fused['apply_with_copy_s'])} "
              f"with the copy (+{ms(fused['copy_in_update_s'])}); publish -> swapped of that copy "
              f"{ms(fused['owned_publish_to_swap_s'])} ({'handed over, no copy' if fused['owned_handed_over'] else 'copied'})")
        print(f"  -> this hand-off {ms(total)}: {total / raw_s:.2f}x the raw copy of the same bytes "
              f"({total / raw_source_s:.2f}x of the source bytes), against {swap_s / raw_s:.2f}x for the channel's own copy")
        fused.update(update_written_vs_raw_copy=total / raw_s, update_written_vs_raw_copy_source_bytes=total / raw_source_s)
    report = {"benchmark": "handoff", "preset": args.preset, "host_only": args.host_only, "device": dev.device_kind,
              "backend": jax.default_backend(), "leaves": n_leaves, "sampler_dtype": args.sampler_dtype,
              "bytes_written": int(written), "source_bytes": int(source), "reshard_s": reshard_s,
              "publish_to_swap_s": swap_s, "raw_copy_s": raw_s, "raw_copy_source_bytes_s": raw_source_s,
              "ratio_vs_raw_copy": reshard_s / raw_s, "ratio_vs_raw_copy_source_bytes": reshard_s / raw_source_s,
              "publish_to_swap_vs_raw_copy": swap_s / raw_s, "state_rebuild_s": as_state_s,
              "dispatch_state_s": state_dispatch_s, "dispatch_flat_s": flat_dispatch_s, **fused}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
