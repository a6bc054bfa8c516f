"""Data-parallel rollout (sampler.replicas) against one engine over the same rollout devices.

Three layouts of the same rollout devices and the same total slots decode the same requests:

- "fsdp":     one engine on a (fsdp=N, tensor=1) mesh, the weights split over fsdp by the training rules (what the
              rollout mesh did before it had replicas): every device decodes every slot and gathers the weights
              every step;
- "tensor":   one engine on a (1, N) mesh, the default when rollout_tensor is -1: heads and MLP split over the
              devices, activations reduced across them every layer;
- "replicas": N samplers on one device each (`mesh.rollout_tensor=1`), each with its share of the slots.

For each layout the compiled k-step decode dispatch is read (XLA's per-device FLOPs and the bytes of its
collectives, both for one decode step: XLA's analysis counts the body of the k-step loop once), then the requests (long-tailed forced lengths) run through the sampler and its generated tokens/s
is timed. The FLOPs and bytes do not depend on the device; the timing does: host devices on a CPU share its cores,
so there the layouts' times mostly show their duplicated work and traffic, not N devices working in parallel.
Ends with one JSON line.

    python benchmarks/rollout_replicas.py                 # the 5.25M benchmark model, 2 host devices, ~1 min
    python benchmarks/rollout_replicas.py --devices 4 --slots 32
"""
from __future__ import annotations

import os
import sys

if "--devices" in sys.argv:
    _n = sys.argv[sys.argv.index("--devices") + 1]
else:
    _n = "2"
if "JAX_PLATFORMS" not in os.environ or os.environ["JAX_PLATFORMS"] == "cpu":
    from areal_jax.runtime.host_devices import use_host_devices

    use_host_devices(int(_n))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import add_model_args, model_config  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from areal_jax.runtime.mesh import MESH_AXES, replica_meshes, rollout_mesh  # noqa: E402
from areal_jax.sampler import Engine, Request, SamplerLoop  # noqa: E402
from areal_jax.sampler.introspect import decode_steps_program  # noqa: E402
from areal_jax.sampler.replicas import SamplerReplicas  # noqa: E402
from areal_jax.system.loadgen import long_tail_lengths  # noqa: E402
from areal_jax.system.params import ParamChannel  # noqa: E402
from areal_jax.testing.hlo import DTYPE_BYTES, collectives  # noqa: E402
from areal_jax.testing.models import random_model  # noqa: E402

LAYOUTS = ("fsdp", "tensor", "replicas")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--devices", type=int, default=2, help="rollout devices")
    p.add_argument("--slots", type=int, default=16, help="decode slots in all (each replica gets slots / devices)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--median", type=int, default=48, help="median generation length")
    p.add_argument("--cap", type=int, default=192, help="longest generation")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    return p.parse_args(argv)


def dispatch_cost(engine: Engine, params, k: int) -> dict[str, float]:
    """Per-device FLOPs and collective bytes of one decode step of the engine's compiled k-step dispatch (the
    loop's body, which XLA's analysis and the program text hold once)."""
    compiled = decode_steps_program(engine, params, k)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    found = collectives(compiled.as_text())
    return {"flops_per_device": float(cost.get("flops", 0.0)),
            "collective_bytes": float(sum(int(np.prod(s, dtype=np.int64)) * DTYPE_BYTES[d] for _, d, s in found)),
            "collectives": len(found)}


def build(layout: str, model, devices, slots: int, max_len: int, k: int, seed: int):
    """(sampler, engines) of one layout."""
    n = len(devices)
    if layout == "replicas":
        mesh = rollout_mesh(devices, n, 1)
        params = ParamChannel.for_model(model, mesh).reshard(nnx.split(model)[1])
        engines = [Engine(model, num_slots=slots // n, max_len=max_len, mesh=m) for m in replica_meshes(mesh)]
        sampler = SamplerReplicas(engines, params, decode_steps=k, seed=seed)
    else:
        shape = (n, 1) if layout == "fsdp" else (1, n)
        mesh = Mesh(np.array(devices).reshape(shape), MESH_AXES)
        engines = [Engine(model, num_slots=slots, max_len=max_len, mesh=mesh)]
        sampler = SamplerLoop(engines[0], nnx.split(model)[1], decode_steps=k, seed=seed)
    return sampler, engines


def run_layout(layout: str, args, model, lengths: np.ndarray) -> dict:
    devices = jax.devices()[:args.devices]
    max_len = 32 + args.cap + 1
    sampler, engines = build(layout, model, devices, args.slots, max_len, args.decode_steps, seed=3)
    try:
        cost = dispatch_cost(engines[0], nnx.split(model)[1], args.decode_steps)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, model.cfg.vocab_size, rng.integers(8, 32)).tolist() for _ in lengths]

        def serve(n: int, offset: int) -> tuple[int, float]:
            sampler.pause()
            for i in range(n):
                sampler.submit(Request(id=offset + i, prompt=prompts[i], max_new_tokens=int(lengths[i]),
                                       temperature=1.0))
            t0 = time.perf_counter()
            sampler.resume()
            tokens = 0
            for _ in range(n):
                c = sampler.get_completion(timeout=600)
                if c is None:
                    raise SystemExit(f"{layout}: the sampler stopped before every request finished")
                tokens += len(c.tokens)
            return tokens, time.perf_counter() - t0

        serve(min(len(lengths), 2 * args.slots), 10_000)  # compiles every program the run needs
        tokens, seconds = serve(len(lengths), 0)
        stats = sampler.stats()
    finally:
        sampler.stop(graceful=False)
    return {**cost, "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "occupancy": float(stats["mean_slot_occupancy"]), "engines": len(engines),
            "slots_per_engine": engines[0].num_slots}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if len(jax.devices()) < args.devices:
        raise SystemExit(f"--devices {args.devices} but only {len(jax.devices())} devices are visible.")
    if args.slots % args.devices:
        raise SystemExit(f"--slots {args.slots} must divide among the {args.devices} replicas.")
    cfg = model_config(args)
    model = random_model(cfg, seed=1)
    lengths = long_tail_lengths(args.requests, args.median, args.cap, seed=4)
    device = jax.devices()[0].device_kind
    print(f"model of {cfg.num_params / 1e6:.2f}M params, {args.devices} rollout devices ({device}), {args.slots} slots "
          f"in all, {args.requests} requests (lengths median {args.median}, cap {args.cap}, "
          f"{int(lengths.sum())} tokens), k={args.decode_steps}")
    results = {}
    for layout in args.layouts.split(","):
        r = results[layout] = run_layout(layout, args, model, lengths)
        print(f"  {layout:9s} {r['engines']} engine(s) x {r['slots_per_engine']:3d} slots: per decode step "
              f"{r['flops_per_device'] / 1e6:7.1f} MFLOP per device, {r['collectives']:3d} collectives of "
              f"{r['collective_bytes'] / 2**20:6.2f} MiB; {r['tokens_per_s']:8.1f} tokens/s, occupancy "
              f"{r['occupancy']:.2f}")
    summary = {"benchmark": "rollout_replicas", "device": device, "devices": args.devices, "params": cfg.num_params,
               "results": results}
    if "replicas" in results:
        for other in ("fsdp", "tensor"):
            if other in results:
                summary[f"speedup_vs_{other}"] = results["replicas"]["tokens_per_s"] / results[other]["tokens_per_s"]
                print(f"  replicas / {other}: {summary[f'speedup_vs_{other}']:.2f}x the tokens/s ({device})")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
