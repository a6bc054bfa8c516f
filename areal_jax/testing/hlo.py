"""Reading a compiled program's text (`compiled.as_text()`, or XLA's dumps): its collectives."""
from __future__ import annotations

import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
FLOATS = ("f32", "bf16", "f16")


def collectives(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(kind, dtype, shape) of every collective instruction in an HLO module's text; a tuple-shaped result (XLA
    combines collectives) element by element."""
    out = []
    pattern = r"^\s*(?:ROOT )?%\S+ = (.*?) (" + "|".join(KINDS) + r")(?:-start)?\("
    dtypes = "|".join(DTYPE_BYTES)
    for m in re.finditer(pattern, hlo, re.M):
        for dtype, dims in re.findall(r"(" + dtypes + r")\[([0-9,]*)\]", m.group(1)):
            out.append((m.group(2), dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out
