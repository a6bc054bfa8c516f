"""The dense cache's decode attention, chosen by measuring it: ``decode_attention="auto"``.

Two paths compute a decode step's attention over the dense cache. XLA's (`cache_attention.cached_attention`) reads
every position of the cache on GPUs, each step; the ragged kernel (`models.ragged_decode`) reads each row only up
to its own length, in many short programs. Which is faster depends on the GPU, the shapes and how full the rows
are, and the kernel must also compile under the installed Triton. "auto" settles it once per process and shape: on
a GPU it times one layer's decode attention both ways at the engine's own per-device shapes, the kernel at its
default tiling and a few others, with rows at lengths spread evenly over the cache (half of it live; in an RL
steady state less is, and the kernel's gain grows as less is live, so this errs toward XLA), in rounds of one
run of each candidate, each candidate's best round counting. It takes the kernel
only where it compiled, its output matched XLA's, and it was at least `MARGIN` faster; anything else keeps XLA,
with the reason. Off GPUs "auto" is XLA (the kernel runs there only in the Pallas interpreter, for tests); so it is
where the kernel does not apply (head widths that are not powers of two, latent attention, no full-length layer),
and on a sampler mesh that spans processes (each would time on its own and could compile another program).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from areal_jax.models import ragged_decode as rd
from areal_jax.models.cache_attention import cached_attention, counted_decode_loops
from areal_jax.models.mla import cache_layout
from areal_jax.models.ragged_decode import blocks_per_row, decode_path, default_tiling, supports
from areal_jax.models.transformer import cache_dtype

MARGIN = 0.03  # the kernel must beat XLA's time by this share to be taken (timings of a few ms jitter by ~1%)
INNER = 8  # attention calls per timed program (each feeding the next), so that dispatch is not what is timed
REPEATS = 5  # rounds of timed runs, one of each candidate a round (after one untimed run); the best counts
TIMING_BYTES = 0.25  # share of the device's free memory one layer's timing caches may take (else XLA, untimed)
Timer = Callable[[str, Callable[[], Any]], float]  # (candidate, run) -> seconds of one run (INNER calls)


@dataclasses.dataclass(frozen=True)
class DecodeChoice:
    """The decode attention an engine runs: path "xla" or "kernel" over the dense cache, "gather" or "kernel" over
    pages (cache "paged", `sampler.paged_choice`); tiling (splits, block) of the kernel (None: its default; over
    pages a block counts pages); seconds: each timed candidate's time for one layer's attention ("xla" / "gather",
    "kernel SxB"); reason: why this path; spent: the wall time the choice took (its compiles and timings), seconds."""

    path: str
    tiling: tuple[int, int] | None = None
    seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    reason: str = ""
    spent: float = 0.0
    cache: str = "dense"

    def describe(self) -> str:
        timed = ", ".join(f"{name} {s * 1e6:.1f} us" for name, s in self.seconds.items())
        unit = "pages a block" if self.cache == "paged" else "block"
        tiling = f" at {self.tiling[0]}x{self.tiling[1]} (splits x {unit})" if self.tiling else ""
        spent = f"; chosen in {self.spent:.1f} s" if self.spent else ""
        return f"{self.path}{tiling}: {self.reason}" + (f" (one layer: {timed}{spent})" if timed else "")

    def as_dict(self) -> dict:
        return {"cache": self.cache, "path": self.path, "tiling": None if self.tiling is None else f"{self.tiling[0]}x{self.tiling[1]}",
                "reason": self.reason, "us": {k: round(v * 1e6, 2) for k, v in self.seconds.items()},
                "spent_s": round(self.spent, 2)}


def candidate_tilings(rows: int, heads: int, kv_heads: int, max_len: int, width: int) -> list[tuple[int, int]]:
    """(splits, block) tilings to time: the kernel's default first, then twice the splits, half the block, and
    both (each kept only where every split holds a block)."""
    block, splits, _ = default_tiling(rows, heads, kv_heads, max_len, width)
    out = [(splits, block)]
    for s, b in ((2 * splits, block), (splits, block // 2), (2 * splits, block // 2)):
        if b >= 16 and s <= blocks_per_row(max_len, b) and (s, b) not in out:
            out.append((s, b))
    return out


class _Clock:
    """The real Timer: one timed run of a candidate's program, after one untimed run (its compile) the first
    time a candidate is asked for."""

    def __init__(self) -> None:
        self.warm: set[str] = set()

    def __call__(self, name: str, run: Callable[[], Any]) -> float:
        if name not in self.warm:
            jax.block_until_ready(run())
            self.warm.add(name)
        start = time.perf_counter()
        jax.block_until_ready(run())
        return time.perf_counter() - start


def _free_bytes(device: Any) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


_CHOICES: dict[tuple, DecodeChoice] = {}


def choose(config: Any, rows: int, max_len: int, mesh: jax.sharding.Mesh | None = None, *,
           backend: str | None = None, timer: Timer | None = None, interpret: bool | None = None) -> DecodeChoice:
    """The decode attention "auto" means for an Engine of `rows` slots of `max_len` positions of this model
    config on `mesh` (see the module's docstring). backend, timer (candidate name, run -> seconds of INNER calls)
    and interpret: for tests (a fake clock; the kernel in the interpreter). Choices made with the real clock are
    kept for the process, per device kind and shape."""
    backend = jax.default_backend() if backend is None else backend
    if backend != "gpu":
        return DecodeChoice("xla", reason=f"the ragged kernel is a GPU kernel and this backend is {backend}")
    kv, dh, dv = cache_layout(config)
    heads = config.num_heads
    if config.mla is not None or not supports(dh, dv, max_len) or heads % kv:
        return DecodeChoice("xla", reason=f"the kernel does not take this cache (kv heads {kv}, widths {dh} / {dv}, "
                                          f"{max_len} positions)")
    linear = config.layer_is_linear if getattr(config, "recurrent", False) else (lambda i: False)
    if all(linear(i) or config.layer_window(i) is not None for i in range(config.num_layers)):
        return DecodeChoice("xla", reason="no attention layer reads the whole cache (sliding windows and linear "
                                          "attention take their own paths)")
    if mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1:
        return DecodeChoice("xla", reason="the sampler's mesh spans processes, whose timings could disagree (each "
                                          "would compile another program); time the shape with "
                                          "benchmarks/ragged_decode.py and set decode_attention=kernel to take it")
    tensor = int(mesh.shape.get("tensor", 1)) if mesh is not None else 1
    if tensor > 1 and kv % tensor == 0 and heads % tensor == 0:  # the kernel runs on each device's heads
        kv, heads = kv // tensor, heads // tensor
    return choose_shape(rows, max_len, heads, kv, dh, dv, cache_dtype(config, backend),
                        softcap=config.attn_logit_softcap, sinks=bool(getattr(config, "attention_sinks", False)),
                        device=mesh.devices.flat[0] if mesh is not None else None, timer=timer, interpret=interpret)


def choose_shape(rows: int, max_len: int, heads: int, kv_heads: int, head_dim: int, value_dim: int, dtype: Any, *,
                 softcap: float | None = None, sinks: bool = False, device: Any = None, timer: Timer | None = None,
                 interpret: bool | None = None) -> DecodeChoice:
    """`choose` for one device's decode attention: `rows` queries of `heads` heads over [rows, max_len, kv_heads,
    head_dim] keys and value_dim-wide values of `dtype` (the kernel must take them: `ragged_decode.supports`),
    timed on `device` (default JAX's first). Choices made with the real clock are kept for the process."""
    device = jax.devices()[0] if device is None else device
    dtype = jnp.dtype(dtype)
    key = (device.device_kind, rows, max_len, heads, kv_heads, head_dim, value_dim, dtype.name, softcap, sinks)
    nbytes = rows * max_len * kv_heads * (head_dim + value_dim) * dtype.itemsize
    return settle(key, nbytes, device, timer, "xla", lambda clock: _timed(
        rows, max_len, heads, kv_heads, head_dim, value_dim, dtype, softcap, sinks, device, clock, interpret))


def settle(key: tuple, nbytes: int, device: Any, timer: Timer | None, fallback: str,
           time_it: Callable[[Timer], DecodeChoice], cache: str = "dense") -> DecodeChoice:
    """time_it(timer) where `nbytes` of timing buffers fit TIMING_BYTES of the device's free memory (else
    `fallback`, untimed), with the wall time it took; choices made with the real clock (timer None) are kept for
    the process under `key`."""
    if timer is None and key in _CHOICES:
        return _CHOICES[key]
    free = _free_bytes(device)
    if free is not None and nbytes > TIMING_BYTES * free:
        return DecodeChoice(fallback, cache=cache, reason=f"no room to time the kernel: one layer's buffers "
                                                          f"({nbytes / 2**20:.0f} MiB) are over {TIMING_BYTES:.0%} of "
                                                          f"the {free / 2**20:.0f} MiB free")
    start = time.perf_counter()
    choice = time_it(timer or _Clock())
    choice = dataclasses.replace(choice, spent=time.perf_counter() - start)
    if timer is None:
        _CHOICES[key] = choice
    return choice


def _timed(rows: int, max_len: int, heads: int, kv: int, dh: int, dv: int, dtype: Any, softcap: float | None,
           sinks: bool, device: Any, timer: Timer, interpret: bool | None) -> DecodeChoice:
    lengths = np.random.default_rng(0).integers(1, max_len + 1, size=rows).astype(np.int32)  # half the cache live
    try:
        with jax.default_device(device):
            keys = jax.random.split(jax.random.key(0), 4)
            inputs = (jax.random.normal(keys[0], (rows, heads, dh), dtype),
                      jax.random.normal(keys[1], (rows, max_len, kv, dh), dtype),
                      jax.random.normal(keys[2], (rows, max_len, kv, dv), dtype), jnp.asarray(lengths),
                      jax.random.normal(keys[3], (heads,), jnp.float32) if sinks else None)
    except Exception as err:  # noqa: BLE001 - out of memory, say: the engine still runs XLA's path
        return DecodeChoice("xla", reason=f"timing XLA's path failed ({first_line(err)})")
    kernels = {tiling: _kernel(softcap, tiling, interpret)
               for tiling in candidate_tilings(rows, heads, kv, max_len, max(dh, dv))}
    return race(inputs, ("xla", "XLA", _xla(softcap)), kernels, dtype, timer)


def race(inputs: tuple, baseline: tuple[str, str, Callable[..., jax.Array]],
         kernels: Mapping[tuple[int, int], Callable[..., jax.Array]], dtype: Any, timer: Timer,
         cache: str = "dense") -> DecodeChoice:
    """Times the baseline (path, its name in reasons, attend) and each kernel tiling's attend on `inputs`
    (attend(q [B, H, Dh], *rest) -> [B, H, Dv]), and returns the kernel at its fastest tiling where it ran,
    matched the baseline's output and beat its time by MARGIN; else the baseline, with the reason. The timed runs
    go in REPEATS rounds of one run of each candidate, so a slow spell of the device (clocks rising from idle,
    other work) falls on every candidate alike, and each candidate's best round counts."""
    path, label, reference = baseline
    try:
        want = jax.jit(reference)(*inputs)
    except Exception as err:  # noqa: BLE001 - out of memory, say: the engine still runs the baseline
        return DecodeChoice(path, reason=f"timing {label} failed ({first_line(err)})", cache=cache)
    runs = {path: functools.partial(_looped(reference), *inputs)}
    failures = []
    tol = 2e-2 if jnp.dtype(dtype).itemsize < 4 else 5e-3  # bf16 outputs; float32 products in TF32 on GPUs
    for tiling, attend in kernels.items():
        name = f"kernel {tiling[0]}x{tiling[1]}"
        try:
            got = jax.jit(attend)(*inputs)
            gap = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            if gap <= tol * max(1.0, float(jnp.max(jnp.abs(want.astype(jnp.float32))))):
                runs[name] = functools.partial(_looped(attend), *inputs)
            else:
                failures.append(f"{name} differs from {label}'s output by {gap:.3g}")
        except Exception as err:  # noqa: BLE001 - a kernel Triton cannot compile or run leaves the baseline
            failures.append(f"{name} failed ({first_line(err)})")
    seconds: dict[str, float] = {}
    for _ in range(REPEATS):
        for name in list(runs):
            try:
                took = timer(name, runs[name]) / INNER
            except Exception as err:  # noqa: BLE001 - the baseline out of memory; a kernel failing to run
                if name == path:
                    return DecodeChoice(path, reason=f"timing {label} failed ({first_line(err)})", cache=cache)
                failures.append(f"{name} failed ({first_line(err)})")
                del runs[name]
                seconds.pop(name, None)
                continue
            seconds[name] = min(took, seconds.get(name, took))
    note = f"; {'; '.join(failures)}" if failures else ""
    timed = {n: s for n, s in seconds.items() if n != path}
    if not timed:
        return DecodeChoice(path, seconds=seconds, reason=f"no kernel tiling ran{note}", cache=cache)
    best = min(timed, key=timed.get)
    splits, block = (int(x) for x in best.split()[1].split("x"))
    ratio = seconds[path] / timed[best]
    if timed[best] <= (1 - MARGIN) * seconds[path]:
        return DecodeChoice("kernel", (splits, block), seconds, f"{ratio:.2f}x {label}'s time{note}", cache=cache)
    return DecodeChoice(path, seconds=seconds, reason=f"the best kernel tiling ({best.split()[1]}) was only "
                                                      f"{ratio:.2f}x {label}'s speed{note}", cache=cache)


def first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _xla(softcap: float | None) -> Callable[..., jax.Array]:
    """XLA's decode attention of q [B, H, Dh] over k, v [B, S, K, D], rows up to lengths [B], as a GPU engine's
    decode step runs it (every chunk of the cache read)."""
    def attend(q, k, v, lengths, sinks):
        with counted_decode_loops(True):
            return cached_attention(q[:, None], k, v, (lengths - 1)[:, None], softcap=softcap, sinks=sinks)[:, 0]

    return attend


def _kernel(softcap: float | None, tiling: tuple[int, int], interpret: bool | None) -> Callable[..., jax.Array]:
    def attend(q, k, v, lengths, sinks):
        return rd.ragged_decode_attention(q, k, v, lengths, softcap=softcap, sinks=sinks, splits=tiling[0],
                                          block=tiling[1], interpret=interpret)

    return attend


def _looped(attend: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """INNER calls of attend in one program, each query nudged by the last output (so none is hoisted or dropped);
    the caches are arguments, not constants of the program."""
    def run(q, *rest):
        def body(_, q):
            return q + (1e-3 * attend(q, *rest).astype(jnp.float32).mean(-1, keepdims=True)).astype(q.dtype)

        return lax.fori_loop(0, INNER, body, q)

    return jax.jit(run)


def resolve(choice: str, config: Any, rows: int, max_len: int, mesh: jax.sharding.Mesh | None = None) -> DecodeChoice:
    """An Engine's decode_attention setting ("auto", "xla", "kernel"; `ragged_decode.decode_path`) -> its choice."""
    choice = decode_path(choice)
    if choice != "auto":
        return DecodeChoice(choice, reason="as configured")
    return choose(config, rows, max_len, mesh)
