"""Reading back what Weights & Biases wrote in offline mode (tests of areal_jax.wandb_sink): the records of a
.wandb run file, and a run's logged history per file."""
from __future__ import annotations

import glob
import json
import os
import struct

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
BLOCK = 32 * 1024


def read_wandb_records(path: str) -> list:
    """The protobuf Records of a .wandb file: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
    records, each a 7-byte header (CRC32, little-endian length, FULL / FIRST / MIDDLE / LAST) and its bytes."""
    data = open(path, "rb").read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (it does not start with ':W&B').")
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding at the end
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            from wandb.proto import wandb_internal_pb2

            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def wandb_history(run_dir: str, run_id: str) -> tuple[list[dict[int, dict]], list, list]:
    """Per offline run file of W&B run `run_id` under run_dir/wandb (one per process that logged to it, oldest
    first): {step: {name: value}}, a row's step the value of its logged metric "step" (the job's step) or else W&B's
    internal row counter; the run records (id, project, name); and per file, in the order written, the pairs (W&B's
    internal row counter, the logged "step") and the metric definitions (name or glob, its step metric)."""
    files = sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb")))
    if not files:
        raise FileNotFoundError(f"no offline run file of W&B run {run_id} under {run_dir}/wandb")
    histories, runs, files_info = [], [], []
    for path in files:
        history, counters, metrics = {}, [], []
        histories.append(history)
        files_info.append({"rows": counters, "metrics": metrics})
        for record in read_wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.history.item}
                step = values.pop("step", None)
                counters.append((record.history.step.num, step))
                row = history.setdefault(record.history.step.num if step is None else int(step), {})
                row.update({k: v for k, v in values.items() if not k.startswith("_")})
            elif kind == "run":
                runs.append(record.run)
            elif kind == "metric":
                m = record.metric
                metrics.append((m.name or m.glob_name, m.step_metric))
    return histories, runs, files_info
