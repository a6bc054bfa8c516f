"""What crosses devices in one PPO update on an fsdp mesh: the compiled accumulate program's collectives, with the
trainer's mesh context (activations pinned to batch sharding, Pallas kernels and experts per shard:
docs/scale.md#data-parallel-activations) against without it (XLA's propagation alone, as before).

Each collective of the compiled accumulate program (one micro-step's forward and backward) is counted by the bytes
of its result, as often as it runs (a loop's body, such as the logits chunks', times its trip count), and classed as "weights" when its shape is a parameter's (FSDP gathers, gradient reductions), else as
"activations" (a tensor with a token dimension). Then Trainer.update is timed both ways on the same host devices,
which on a CPU share its cores: the timing shows the cost of the extra traffic and duplicated work only roughly. The
bytes do not depend on the device. Ends with one JSON line.

    python benchmarks/data_parallel.py                          # the 5.25M benchmark model, 4 host devices, ~1 min
    python benchmarks/data_parallel.py --moe                    # a Qwen3-MoE-style model (8 experts, top 2),
                                                                # its experts by FSDP and by expert parallelism
    python benchmarks/data_parallel.py --hidden 896 --layers 2 --heads 14 --kv-heads 2 --intermediate 4864 \\
        --vocab 151936                                          # two layers of the Qwen2.5-0.5B shape
"""
from __future__ import annotations

import os
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="collectives_")
if "--devices" in sys.argv:
    _n = sys.argv[sys.argv.index("--devices") + 1]
else:
    _n = "4"
from areal_jax.runtime.host_devices import host_device_env  # noqa: E402

os.environ.update(host_device_env(int(_n), {"PJRT_NPROC": os.environ.get("PJRT_NPROC", "0")}))
os.environ["XLA_FLAGS"] += f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=accumulate"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import add_model_args, model_config  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.runtime.mesh import MeshConfig, build_meshes  # noqa: E402
from areal_jax.testing.hlo import DTYPE_BYTES, FLOATS, collectives  # noqa: E402
from areal_jax.testing.models import random_model  # noqa: E402
from areal_jax.testing.trajectories import random_trajectories  # noqa: E402
from areal_jax.trainer import Trainer, TrainerConfig  # noqa: E402
from areal_jax.trainer import trainer as trainer_module  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--devices", type=int, default=4, help="host devices on the fsdp axis")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE-style model: 8 experts, top 2, width = intermediate / 4")
    p.add_argument("--moe-impl", default="blocked")
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def classify(found, param_shapes: set[tuple[int, ...]]) -> dict[str, dict[str, int]]:
    """Bytes per (class, kind): "weights" when the float tensor has a parameter's element count and shares its
    first or last dimension (a parameter, reshaped or transposed: [D, H, Dh] moves as [D, H * Dh]), "scalars" for
    scalars, else "activations"."""
    out: dict[str, dict[str, int]] = {"weights": {}, "activations": {}, "scalars": {}}
    keys = {(int(np.prod(s)), d) for s in param_shapes for d in (s[0], s[-1])}
    for kind, dtype, shape in found:
        squeezed = tuple(d for d in shape if d != 1)
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]
        size = int(np.prod(squeezed)) if squeezed else 1
        weight = dtype in FLOATS and squeezed and (
            (size, squeezed[0]) in keys or (size, squeezed[-1]) in keys)
        cls = "scalars" if not squeezed else "weights" if weight else "activations"
        out[cls][kind] = out[cls].get(kind, 0) + nbytes
    return out


def run(args, cfg, with_context: bool) -> dict:
    """Builds a trainer (with or without the mesh context), runs updates, and reads its accumulate program. With
    `cfg.expert_parallel` and the expert count dividing the devices, each device keeps its own experts
    (models.expert_parallel); the tokens' all-gathers and reduce-scatters then count as activations."""
    before = set(glob.glob(os.path.join(DUMP, "*")))
    mesh = build_meshes(MeshConfig(colocated=True, fsdp=args.devices, tensor=1)).train_mesh
    model = random_model(cfg, seed=1)
    params = nnx.state(model, nnx.Param)
    shapes = {tuple(d for d in x.shape if d != 1) for x in jax.tree.leaves(params)}
    shapes |= {s[1:] for s in shapes if len(s) == 3}  # one expert's slice
    n = args.devices  # and each device's shard of one dimension (a gradient reduce-scattered to it)
    shapes |= {s[:d] + (s[d] // n,) + s[d + 1:] for s in list(shapes) for d in range(len(s)) if s[d] % n == 0}
    trajs = random_trajectories(args.trajectories, vocab=cfg.vocab_size, min_len=args.max_len // 4,
                                max_len=args.max_len, seed=2)
    tc = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, logits_chunk=256)
    off = mock.patch.object(jax.sharding, "use_abstract_mesh", lambda m: contextlib.nullcontext())
    trainer_module._FNS_CACHE.clear()  # a fresh build of the update's programs, traced under this choice
    with contextlib.nullcontext() if with_context else off:
        trainer = Trainer(model, tc, mesh)
        t0 = time.perf_counter()
        trainer.update(trajs)  # compiles
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            trainer.update(trajs)
            times.append(time.perf_counter() - t0)
    files = sorted(set(glob.glob(os.path.join(DUMP, "*accumulate*after_optimizations.txt"))) - before)
    if not files:
        raise SystemExit(f"no new accumulate program was dumped under {DUMP}: {sorted(os.listdir(DUMP))[-5:]}")
    found = collectives(open(files[-1]).read(), executed=True)
    return {"bytes": classify(found, shapes), "collectives": len(found), "first_update_s": first,
            "update_s": float(np.median(times))}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = model_config(args)
    if args.moe:
        cfg = cfg.replace(architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=args.intermediate // 4, moe_impl=args.moe_impl, qk_norm=True,
                          attention_bias=False)
    print(f"{'MoE' if args.moe else 'dense'} model of {cfg.num_params / 1e6:.2f}M params, {args.devices} host devices "
          f"on the fsdp axis ({jax.devices()[0].device_kind}), {args.trajectories} trajectories of up to "
          f"{args.max_len} tokens, micro_batch_tokens {args.micro_batch_tokens}")
    results = {}
    runs = [("without", False, False), ("with", True, False)]  # (the mesh context; experts by FSDP)
    if args.moe:
        runs.append(("with, expert parallel", True, True))
    for name, ctx, ep in runs:
        r = results[name] = run(args, cfg.replace(expert_parallel=ep), ctx)
        mib = {c: sum(v.values()) / 2**20 for c, v in r["bytes"].items()}
        print(f"  {name:7s} mesh context: collectives {r['collectives']:4d}, activations {mib['activations']:9.2f} MiB, "
              f"weights {mib['weights']:8.2f} MiB per micro-step; update {r['update_s']:.3f} s "
              f"(first, compiling: {r['first_update_s']:.1f} s)")
        for cls in ("activations", "weights"):
            if r["bytes"][cls]:
                print(f"      {cls}: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(r["bytes"][cls].items())))
    act = {k: sum(v["bytes"]["activations"].values()) for k, v in results.items()}
    summary = {"benchmark": "data_parallel", "device": jax.devices()[0].device_kind, "devices": args.devices,
               "moe": args.moe, "params": cfg.num_params, "results": results,
               "activation_bytes_ratio": act["without"] / max(act["with"], 1),
               "update_speedup": results["without"]["update_s"] / results["with"]["update_s"]}
    print(f"  activation bytes without / with: {summary['activation_bytes_ratio']:.1f}x; update time without / with "
          f"(CPU, shared cores): {summary['update_speedup']:.2f}x")
    if args.moe:
        ep = results["with, expert parallel"]
        moved = {k: sum(sum(v["bytes"][c].values()) for c in ("weights", "activations")) for k, v in results.items()}
        summary["expert_parallel_bytes_ratio"] = moved["with, expert parallel"] / max(moved["with"], 1)
        summary["expert_parallel_speedup"] = results["with"]["update_s"] / ep["update_s"]
        print(f"  expert parallel against FSDP experts (both with the context): bytes moved "
              f"{summary['expert_parallel_bytes_ratio']:.2f}x, update speed {summary['expert_parallel_speedup']:.2f}x")
    shutil.rmtree(DUMP, ignore_errors=True)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
