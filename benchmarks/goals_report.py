"""The open goals against the figures a GPU session wrote.

    python benchmarks/goals_report.py runs/gpu_session/results.jsonl

`gpu_session.sh` appends each step's last JSON line to results.jsonl; its `goals` phase ends with this report. For
each goal of the sampler issue and the loop issue it prints the figure, the threshold, the device and PASS / FAIL /
UNMEASURED (no record of that run, or the run ended without its figures), then one JSON line. Where several records
of a run are there (phases run twice), the last one counts. The goals:
- sampler, Qwen2.5-0.5B bf16, 256 slots, steady state: at least 60,000 generated tokens/s on an H200, and at least
  30x HF generate's tokens/s on the same GPU;
- sampler, Qwen2.5-1.5B: 16k-token generations with at least 128 sequences at once (128 slots of 16,384 new tokens,
  mean occupancy 0.95 or more, tokens generated);
- loop, Qwen2.5-0.5B preset: eta 4 trains at least 1.5x the tokens/s of eta 0 (the rate after the first update,
  which every eta's first batch holds back alike; the whole run's ratio is printed beside it);
- weight hand-off: at most 1.5x a raw device copy of the same bytes, in the same run.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

SAMPLER_TOKENS = 60_000
HF_RATIO = 30.0
LONG_SLOTS, LONG_TOKENS, LONG_OCCUPANCY = 128, 16_384, 0.95
ETA_RATIO = 1.5
HANDOFF_RATIO = 1.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="gpu_session.sh's results.jsonl")
    return p.parse_args(argv)


def read_records(path: str) -> list[dict]:
    """The JSON objects of the file, one a line; lines that do not parse are skipped."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


def last(records: list[dict], **match: Any) -> dict | None:
    """The last record whose fields equal `match` (a callable value is a predicate on the field)."""
    found = None
    for r in records:
        if all(v(r.get(k)) if callable(v) else r.get(k) == v for k, v in match.items()):
            found = r
    return found


def verdict(value: float | None, threshold: float, at_least: bool = True) -> str:
    if value is None:
        return "UNMEASURED"
    return "PASS" if (value >= threshold if at_least else value <= threshold) else "FAIL"


def goals(records: list[dict]) -> list[dict]:
    """One row per goal: name, value, threshold, direction, verdict, device, note."""
    rows = []

    def add(name: str, value: float | None, threshold: float, device: str | None, note: str = "",
            at_least: bool = True) -> None:
        rows.append({"goal": name, "value": value, "threshold": threshold, "at_least": at_least,
                     "verdict": verdict(value, threshold, at_least), "device": device, "note": note})

    s = last(records, benchmark="sampler", preset="qwen2.5-0.5b", num_slots=256,
             steady=lambda v: isinstance(v, dict))
    steady = s["steady"].get("tokens_per_s") if s else None
    device = s.get("device_kind") if s else None
    note = "" if device is None or "H200" in device else "the goal names an H200"
    if s and s.get("dtype") != "bfloat16":
        note = "not bf16"
    add("sampler 0.5B steady tokens/s (256 slots)", steady, SAMPLER_TOKENS, device, note)
    hf = (s or {}).get("tokens_per_s", {}).get("hf")
    add("sampler 0.5B steady / HF generate", steady / hf if steady and hf else None, HF_RATIO, device,
        "" if hf else "no HF figure in the run")

    long = last(records, benchmark="sampler", preset="qwen2.5-1.5b",
                max_new_tokens=lambda v: isinstance(v, int) and v >= LONG_TOKENS)
    concurrent = None
    if long and long.get("generated_tokens", 0) > 0:
        occupancy = long.get("mean_slot_occupancy", 0.0)  # the slots filled at once, prefills and all
        concurrent = long["num_slots"] * (1.0 if occupancy >= LONG_OCCUPANCY else occupancy)
    add("1.5B 16k-token generations at once", concurrent, LONG_SLOTS, long and long.get("device_kind"),
        "" if long is None else f"{long['num_slots']} slots, occupancy {long.get('mean_slot_occupancy', 0):.2f}, "
                                f"{long.get('generated_tokens', 0):,} tokens")

    loop = last(records, benchmark="loop", preset="qwen2.5-0.5b")
    by_eta = {r.get("eta"): r for r in (loop or {}).get("results", [])}
    zero, four = by_eta.get(0), by_eta.get(4)
    after = whole = None
    if zero and four:
        a, b = four.get("trained_tokens_per_s_after_first"), zero.get("trained_tokens_per_s_after_first")
        after = a / b if a and b else None
        whole = four["trained_tokens_per_s"] / zero["trained_tokens_per_s"] if zero.get("trained_tokens_per_s") \
            else None
    add("loop 0.5B: eta 4 / eta 0 trained tokens/s (after the first update)", after, ETA_RATIO,
        loop and loop.get("device"), "" if whole is None else f"whole run {whole:.2f}x")

    handoff = None
    for r in (loop or {}).get("results", []):
        handoff = r.get("handoff") or handoff
    add("hand-off / raw copy of the same bytes", handoff and handoff.get("ratio_vs_raw_copy"), HANDOFF_RATIO,
        loop and loop.get("device"),
        "" if not handoff else f"{handoff['bytes_moved'] / 1e6:.0f} MB; against the float32 source's copy "
                               f"{handoff['ratio_vs_raw_copy_source_bytes']:.2f}x", at_least=False)
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rows = goals(read_records(args.results))
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:,.2f}"
        sign = ">=" if r["at_least"] else "<="
        print(f"{r['verdict']:10s} {r['goal']}: {value} ({sign} {r['threshold']:,}) on {r['device'] or '-'}"
              + (f"; {r['note']}" if r["note"] else ""))
    out = {"benchmark": "goals_report", "goals": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
