"""Expert parallelism against FSDP experts for one mixture-of-experts layer at a real model's shape, as the trainer
compiles it: forward + backward of one micro-batch under an fsdp mesh context (models.sharding,
models.expert_parallel), on N host devices standing in for N accelerators. Three layouts: "fsdp" (every expert's
weights gathered), "expert_parallel" (each device's experts whole, the rows all-gathered to them) and "ring" (the
same experts, the rows passed round the fsdp ring: `model.expert_dispatch=ring`).

For each layout the layer is compiled once (nothing is allocated at the real shape: abstract
arrays) and the compiled program is read:

- per-device memory XLA reports: arguments (the layer's weight shards and the rows), temporaries (what the
  program allocates beyond them: FSDP's gathered experts, expert parallelism's gathered rows and buffers);
- what crosses devices, per device and micro-batch, from the program's collectives as often as they run (a loop's
  times its trip count), as a ring moves them: an all-gather receives (n - 1) / n of its result, a reduce-scatter
  (n - 1) times its result, an all-reduce 2 (n - 1) / n of it, an all-to-all (n - 1) / n, a collective-permute
  its result.

Both figures are properties of the compiled program, the same on any backend that compiles it the same way (XLA:CPU
here; XLA:GPU fuses and schedules differently, so a GPU's temporaries differ). With --run (small shapes) both
programs also run on random weights and their outputs and gradients are compared. --sweep 4,8,16 compiles the two
expert-parallel layouts again on fewer devices, the tokens a device kept (--tokens / --devices), to show how each
one's temporaries grow with the fsdp size. Ends with one JSON line.

    python benchmarks/expert_parallel.py                                  # Qwen3-30B-A3B's layer, 8 devices, ~3 min
    python benchmarks/expert_parallel.py --preset deepseek-v3 --devices 16 --tokens 32768 --sweep 4,8,16
    python benchmarks/expert_parallel.py --preset small --devices 4 --tokens 2048 --run
"""
from __future__ import annotations

import os
import sys

if "--devices" in sys.argv:
    _n = int(sys.argv[sys.argv.index("--devices") + 1])
else:
    _n = 8
from areal_jax.runtime.host_devices import host_device_env  # noqa: E402

os.environ.update(host_device_env(_n, {"PJRT_NPROC": os.environ.get("PJRT_NPROC", "0")}))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

from areal_jax.models.moe import MoE  # noqa: E402
from areal_jax.models.sharding import logical_to_mesh_sharding  # noqa: E402
from areal_jax.testing.hlo import DTYPE_BYTES, collectives  # noqa: E402
from areal_jax.testing.models import tiny_config  # noqa: E402

PRESETS = {  # hidden, experts, top-k, expert width
    "small": (256, 16, 4, 128),
    "qwen3-30b-a3b": (2048, 128, 8, 768),
    "mixtral-8x7b": (4096, 8, 2, 14336),
    "deepseek-v3": (7168, 256, 8, 2048),
}
WIRE = {"all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: n - 1, "all-reduce": lambda n: 2 * (n - 1) / n,
        "all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=tuple(PRESETS))
    p.add_argument("--devices", type=int, default=8, help="host devices on the fsdp axis")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of one micro-batch, over all devices")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype (params are float32, as the trainer's master weights; XLA:CPU carries 16-bit "
                   "collectives in float32, so its bytes moved are float32's)")
    p.add_argument("--impl", default="blocked", choices=("blocked", "pallas", "ragged", "dense"))
    p.add_argument("--run", action="store_true", help="also run all three on random weights (small shapes) and compare")
    p.add_argument("--sweep", default="", help="comma-separated fsdp sizes (each at most --devices) to compile the "
                   "expert-parallel layouts on, at --tokens / --devices tokens a device")
    return p.parse_args(argv)


LAYOUTS = {"fsdp": (False, "gather"), "expert_parallel": (True, "gather"), "ring": (True, "ring")}


def layer_config(args: argparse.Namespace, layout: str):
    d, e, k, f = PRESETS[args.preset]
    expert_parallel, dispatch = LAYOUTS[layout]
    return tiny_config("qwen3_moe", hidden_size=d, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=f,
                       norm_topk_prob=True, moe_impl=args.impl, expert_parallel=expert_parallel,
                       expert_dispatch=dispatch, dtype=jnp.dtype(args.dtype), param_dtype=jnp.float32)


def program(args: argparse.Namespace, mesh, layout: str, tokens: int | None = None):
    """(jitted step, abstract state with shardings, abstract rows): the layer's output and the gradients of a fixed
    projection of it with respect to the rows and every weight, traced under the mesh context as the trainer's."""
    cfg = layer_config(args, layout)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0))))
    shardings = logical_to_mesh_sharding(state, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
    rows = jax.ShapeDtypeStruct((tokens or args.tokens, cfg.hidden_size), cfg.dtype,
                                sharding=NamedSharding(mesh, PartitionSpec("fsdp", None)))

    def loss(st, x):
        out = nnx.merge(graphdef, st)(x)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32)))

    def step(st, x):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.value_and_grad(loss, argnums=(0, 1))(st, x)

    # the gradients sharded like the params, as the trainer's (not replicated: that would add all-reduces)
    return jax.jit(step, out_shardings=(NamedSharding(mesh, PartitionSpec()), (shardings, rows.sharding))), state, rows


def wire_bytes(text: str, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind, dtype, shape in collectives(text, executed=True):  # (the ring's, in a loop, once a step)
        out[kind] = out.get(kind, 0.0) + WIRE[kind](n) * int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]
    return out


def measure(args: argparse.Namespace, mesh, layout: str, tokens: int | None = None) -> dict:
    step, state, rows = program(args, mesh, layout, tokens)
    t0 = time.perf_counter()
    compiled = step.lower(state, rows).compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    moved = wire_bytes(compiled.as_text(), mesh.shape["fsdp"])
    gate = state["experts_gate"].get_value() if hasattr(state["experts_gate"], "get_value") else state["experts_gate"]
    return {"compile_s": seconds, "argument_bytes": int(mem.argument_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
            "wire_bytes": moved, "wire_total": float(sum(moved.values())), "expert_spec": str(gate.sharding.spec)}


def run_all(args: argparse.Namespace, mesh) -> dict:
    """The three programs on the same random weights and rows: outputs and gradients against FSDP's, time per step."""
    results, times = [], {}
    for layout in LAYOUTS:
        step, state, rows = program(args, mesh, layout)
        rng = np.random.default_rng(0)  # the same weights for both
        values = jax.tree.map(lambda a: jax.device_put(
            jnp.asarray(0.05 * rng.standard_normal(a.shape), a.dtype), a.sharding), state)
        x = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal(rows.shape), rows.dtype), rows.sharding)
        out = jax.block_until_ready(step(values, x))
        t0 = time.perf_counter()
        for _ in range(3):
            out = jax.block_until_ready(step(values, x))
        times[layout] = (time.perf_counter() - t0) / 3
        results.append(jax.device_get(out))
    err = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))) /
                    max(float(np.max(np.abs(np.asarray(b, np.float32)))), 1e-30))
              for other in results[1:] for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(results[0])))
    return {"step_s": times, "max_rel_diff": err}


def describe(name: str, r: dict, gib: float, unit: str) -> str:
    return (f"  {name:16s} experts {r['expert_spec']:24s} per device: arguments {r['argument_bytes'] / gib:7.2f} {unit}, "
            f"temporaries {r['temp_bytes'] / gib:7.2f} {unit}, moved {r['wire_total'] / gib:7.2f} {unit} "
            f"({', '.join(f'{kk} {v / gib:.2f}' for kk, v in sorted(r['wire_bytes'].items()))}); "
            f"compiled in {r['compile_s']:.1f} s")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    d, e, k, f = PRESETS[args.preset]
    sweep = [int(n) for n in args.sweep.split(",") if n]
    for n in (args.devices, *sweep):
        if e % n or n > args.devices:
            raise SystemExit(f"{e} experts over {n} devices: expert parallelism needs a divisor of the expert count, "
                             f"at most --devices={args.devices}.")
    mesh = jax.make_mesh((args.devices, 1), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    print(f"one MoE layer at {args.preset}'s shape (hidden {d}, {e} experts of {f}, top {k}), {args.dtype}, "
          f"{args.tokens} tokens a micro-batch over {args.devices} host devices ({jax.devices()[0].device_kind}), "
          f"impl {args.impl}: forward + backward as compiled")
    gib = 2.0 ** 30 if args.preset != "small" else 2.0 ** 20  # GiB (MiB at the small preset)
    unit = "GiB" if args.preset != "small" else "MiB"
    res = {}
    for name in LAYOUTS:
        res[name] = measure(args, mesh, name)
        print(describe(name, res[name], gib, unit))
    ratio = {f"{key}_{name}": res[name][key] / max(res["fsdp"][key], 1)
             for key in ("temp_bytes", "wire_total") for name in ("expert_parallel", "ring")}
    for name in ("expert_parallel", "ring"):
        print(f"  {name} / fsdp: temporaries {ratio[f'temp_bytes_{name}']:.2f}x, bytes moved "
              f"{ratio[f'wire_total_{name}']:.2f}x")
    summary = {"benchmark": "expert_parallel", "device": jax.devices()[0].device_kind, "devices": args.devices,
               "preset": args.preset, "tokens": args.tokens, "dtype": args.dtype, "impl": args.impl, "results": res,
               "temp_ratio": ratio["temp_bytes_expert_parallel"], "moved_ratio": ratio["wire_total_expert_parallel"],
               "ring_temp_ratio": ratio["temp_bytes_ring"], "ring_moved_ratio": ratio["wire_total_ring"]}
    if sweep:
        per_device = args.tokens // args.devices
        print(f"  by fsdp size, {per_device} tokens a device: temporaries a device ({unit})")
        rows = summary["sweep"] = {}
        for n in sweep:
            sub = jax.make_mesh((n, 1), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:n])
            rows[n] = {name: measure(args, sub, name, per_device * n)["temp_bytes"] for name in ("expert_parallel", "ring")}
            print(f"    fsdp {n:3d}: all-gather {rows[n]['expert_parallel'] / gib:8.2f}   ring {rows[n]['ring'] / gib:8.2f}")
    if args.run:
        ran = summary["run"] = run_all(args, mesh)
        print(f"  ran all three: step {', '.join(f'{v:.3f} s ({kk})' for kk, v in ran['step_s'].items())} (host "
              f"devices sharing the CPU's cores); outputs and gradients within {ran['max_rel_diff']:.1e} of FSDP's "
              f"(relative to the largest)")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
