"""Reading a compiled program's text (`compiled.as_text()`, or XLA's dumps): its collectives."""
from __future__ import annotations

import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
FLOATS = ("f32", "bf16", "f16")


def collectives(hlo: str, executed: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """(kind, dtype, shape) of every collective instruction in an HLO module's text; a tuple-shaped result (XLA
    combines collectives) element by element. executed: each as often as it runs, a collective in a loop's body
    repeated by the loop's trip count (`run_counts`), not once as it is written."""
    out = []
    pattern = r"^\s*(?:ROOT )?%\S+ = (.*?) (" + "|".join(KINDS) + r")(?:-start)?\("
    dtypes = "|".join(DTYPE_BYTES)
    runs = run_counts(hlo) if executed else {}
    for name, body in _computations(hlo):
        for m in re.finditer(pattern, body, re.M):
            for dtype, dims in re.findall(r"(" + dtypes + r")\[([0-9,]*)\]", m.group(1)):
                out += [(m.group(2), dtype, tuple(int(d) for d in dims.split(",") if d))] * runs.get(name, 1)
    return out


def _computations(hlo: str) -> list[tuple[str, str]]:
    """(name, text) of each computation of an HLO module's text (the entry's named ENTRY)."""
    parts = re.split(r"^(?=(?:ENTRY )?%\S+ \(.*\{\s*$)", hlo, flags=re.M)
    named = []
    for part in parts:
        m = re.match(r"(ENTRY )?%(\S+) ", part)
        if m:
            named.append(("ENTRY" if m.group(1) else m.group(2), part))
    return named or [("ENTRY", hlo)]


def run_counts(hlo: str) -> dict[str, int]:
    """How many times each computation runs per execution of the module: the entry once, a while loop's body its
    known trip count times its caller's count (1 when XLA knows none), other called computations as often as their
    caller. Computations called from several places add up."""
    calls: dict[str, list[tuple[str, int]]] = {}
    for name, body in _computations(hlo):
        for line in body.splitlines():
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            for key, callee in re.findall(r"(body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)",
                                          line):
                calls.setdefault(name, []).append((callee, int(trips.group(1)) if trips and key == "body" else 1))
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                calls.setdefault(name, []).extend((c.strip().lstrip("%"), 1) for c in group.split(","))
    counts: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        counts[name] = counts.get(name, 0) + times
        for callee, n in calls.get(name, ()):
            visit(callee, times * n)

    visit("ENTRY", 1)
    return counts
