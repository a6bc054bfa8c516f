"""Where the time of a jax.profiler trace went: the top device ops, by total time, and a share per kind.

    python benchmarks/trace_top.py DIR [--top 25] [--json OUT.json]

DIR is the directory given to `jax.profiler.trace(DIR, create_perfetto_trace=True)` (benchmarks/trainer.py
--profile writes one). Reads the newest perfetto_trace.json.gz under it. Device lanes are the processes
named "/device:..." (GPU / TPU streams); on a CPU-only trace the host's XLA client threads stand in for
them. On a GPU trace the kernels on the "Stream" lanes are counted (--lanes 'XLA Ops' counts HLO ops
instead; counting both would count each op twice). Whole-module spans ("XLA Modules", "Steps") are left out so that time is not counted twice. Each
op is put in one kind by its name: matmul (gemm / cuBLAS / cutlass kernels, dot fusions), attention
(the project's Pallas kernels, cuDNN attention), collective, copy / transfer, fusion (other XLA kernels)
and other. Prints busy time per lane, the kinds' shares of device time, the top ops, and one JSON line.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

SKIP_THREADS = re.compile(r"XLA Modules|Steps|Framework|Source|TraceMe|python|Launch Stats", re.I)
# Host-side spans that wrap the ops of a CPU trace (counting them would count the ops twice), and loop /
# conditional ops whose bodies are listed op by op.
WRAPPERS = re.compile(r"^(ThunkExecutor|SlinkyThreadPool|ThreadpoolListener|end: |while|conditional|call)", re.I)
KINDS = (
    ("attention", re.compile(r"flash|attention|_fwd_kernel|_bwd_kernel|mha|paged|fmha|sdpa|cudnn", re.I)),
    ("matmul", re.compile(r"gemm|cublas|cutlass|xmma|dot|matmul|sm90_|nvjet", re.I)),
    ("collective", re.compile(r"all-?reduce|all-?gather|reduce-?scatter|nccl|collective|all-to-all", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|transfer|dynamic-update-slice", re.I)),
    ("fusion", re.compile(r"fusion|reduce|loop_|input_|scatter|gather|convert|transpose|broadcast", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def find_trace(path: str) -> str:
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not found:
        raise SystemExit(f"{path}: no perfetto_trace.json.gz under it; record with "
                         "jax.profiler.trace(DIR, create_perfetto_trace=True)")
    return found[-1]


def summarize(path: str, top: int = 25, lanes_like: str = "") -> dict:
    with gzip.open(find_trace(path), "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    device_pids = {p for p, n in procs.items() if "/device:" in n}
    on_device = bool(device_pids)
    if not on_device:  # a CPU trace: XLA's client threads run the ops
        device_pids = set(procs)
    names = {threads.get((p, t), str(t)) for (p, t) in threads if p in device_pids}
    if not lanes_like:  # GPU traces hold each op twice: kernels on "Stream" lanes, HLO ops on "XLA Ops"
        lanes_like = "Stream" if any("Stream" in n for n in names) else ""
    lanes = collections.Counter()
    ops = collections.defaultdict(lambda: [0.0, 0, ""])
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            continue
        lane = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        if lanes_like and not re.search(lanes_like, lane):
            continue
        if SKIP_THREADS.search(lane) or (not on_device and "XLA" not in lane and "Eigen" not in lane):
            continue
        name, dur = e.get("name", "?"), float(e.get("dur", 0.0))
        if WRAPPERS.search(name):
            continue
        lanes[f"{procs.get(e['pid'], e['pid'])} / {lane}"] += dur
        op = ops[name]
        op[0] += dur
        op[1] += 1
        if not op[2]:
            args = e.get("args") or {}
            op[2] = str(args.get("long_name") or args.get("hlo_op") or args.get("tf_op") or "")[:160]
    total = sum(v[0] for v in ops.values()) or 1.0
    kinds = collections.Counter()
    for name, (dur, _, long_name) in ops.items():
        kinds[kind_of(name + " " + long_name)] += dur
    top_ops = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "trace": find_trace(path), "on_device": on_device, "lanes_like": lanes_like, "total_ms": round(total / 1e3, 3),
        "lanes_ms": {k: round(v / 1e3, 3) for k, v in lanes.most_common()},
        "kinds_share": {k: round(v / total, 4) for k, v in kinds.most_common()},
        "top": [{"name": n[:120], "ms": round(v[0] / 1e3, 3), "count": v[1], "share": round(v[0] / total, 4),
                 "kind": kind_of(n + " " + v[2]), "hlo": v[2]} for n, v in top_ops],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--lanes", default="", help="regex of the lanes to count (default: 'Stream' where a trace has "
                   "stream lanes, i.e. kernels; 'XLA Ops' gives HLO ops instead)")
    p.add_argument("--json", help="also write the summary here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    s = summarize(args.trace_dir, args.top, args.lanes)
    print(f"trace: {s['trace']} ({'device lanes' if s['on_device'] else 'CPU: host XLA threads'})")
    print(f"op time summed over lanes: {s['total_ms']:.1f} ms")
    for lane, ms in list(s["lanes_ms"].items())[:8]:
        print(f"  lane {lane:<60} {ms:10.1f} ms")
    print("share by kind: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in s["kinds_share"].items()))
    for op in s["top"]:
        print(f"  {op['ms']:9.2f} ms {100 * op['share']:5.1f}% x{op['count']:<5} {op['kind']:<10} {op['name'][:70]}"
              + (f"  [{op['hlo'][:60]}]" if op["hlo"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f)
    print(json.dumps({"benchmark": "trace_top", "total_ms": s["total_ms"], "kinds_share": s["kinds_share"],
                      "top5": [(o["name"][:60], o["ms"]) for o in s["top"][:5]]}))
    return s


if __name__ == "__main__":
    main()
