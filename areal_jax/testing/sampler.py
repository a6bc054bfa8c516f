"""Fixtures for sampler tests: an uncached reference forward pass, greedy decoding by it, and loop helpers.

The references are written the slow, obvious way (one full forward pass per token, no KV cache), so the
engine's cached, batched, multi-step decoding can be checked against something computed differently.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx

from areal_jax.models.transformer import Transformer
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.loop import SamplerLoop
from areal_jax.sampler.requests import Completion, Request
from areal_jax.sampler.sampling import SamplingParams

LogpFn = Callable[[Sequence[int]], np.ndarray]


def full_forward_logp(model: Transformer, pad_to: int) -> LogpFn:
    """A jitted reference: f(seq) -> [len(seq), V] float64 log-softmax of a plain forward pass (no cache) at
    every position of seq. The sequence is tail-padded to ``pad_to`` tokens (one compiled program), which
    causal attention makes invisible to the real positions."""
    graphdef, params = nnx.split(model)
    fwd = jax.jit(lambda p, t: jax.nn.log_softmax(nnx.merge(graphdef, p)(t)[0], axis=-1))

    def logp(seq: Sequence[int]) -> np.ndarray:
        padded = np.zeros((1, pad_to), np.int32)
        padded[0, : len(seq)] = seq
        return np.asarray(fwd(params, padded), np.float64)[: len(seq)]

    return logp


def greedy_reference(logp: LogpFn, prompt: Sequence[int], max_new: int,
                     stop: Sequence[int] = ()) -> tuple[list[int], list[float], list[np.ndarray]]:
    """Greedy decoding by repeated full forward passes: (tokens, their logprobs, the [V] log-softmax row
    each token was chosen from); stops after a token in ``stop`` (included) or ``max_new`` tokens."""
    seq, toks, lps, tables = list(prompt), [], [], []
    for _ in range(max_new):
        row = logp(seq)[-1]
        tok = int(np.argmax(row))
        toks.append(tok)
        lps.append(float(row[tok]))
        tables.append(row)
        seq.append(tok)
        if tok in stop:
            break
    return toks, lps, tables


def fill_slots_then_stage(engine: Engine, params: nnx.State, prompts: Sequence[Sequence[int]],
                          budgets: Sequence[int]):
    """A fresh decode state whose slots hold the first ``engine.num_slots`` prompts and whose standby rows hold the
    rest, in order, each decoded greedily for its budget of new tokens."""
    state = engine.init_decode_state()
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        sampling = SamplingParams(temperature=0.0, max_new_tokens=budget)
        prefix = engine.prefill(params, prompt)
        if i < engine.num_slots:
            state = engine.insert(prefix, state, i, sampling)
        else:
            state = engine.stage(prefix, state, [i - engine.num_slots], sampling)
    return state


def token_logp_errors(completion: Completion, logps_by_version: dict[int, LogpFn]) -> np.ndarray:
    """[T] |returned logprob - full-forward logprob under the version that sampled the token| per token."""
    seq, errs = list(completion.prompt), []
    for tok, lp, ver in zip(completion.tokens, completion.logprobs, completion.versions):
        errs.append(abs(logps_by_version[int(ver)](seq)[-1][tok] - lp))
        seq.append(int(tok))
    return np.array(errs)


def collect_completions(loop: SamplerLoop, count: int, timeout: float = 120.0) -> list[Completion]:
    """``count`` completions from ``loop`` (each within ``timeout`` seconds, else AssertionError), sorted by
    (str(request id), sample index)."""
    out = []
    for _ in range(count):
        c = loop.get_completion(timeout=timeout)
        assert c is not None, f"only {len(out)} of {count} completions arrived"
        out.append(c)
    return sorted(out, key=lambda c: (str(c.request_id), c.sample_index))


def collect_while_submitting(loop: SamplerLoop, expected: Callable[[], int], timeout: float = 120.0
                             ) -> dict[tuple, Completion]:
    """Completions of ``loop`` until as many arrived as ``expected()`` says (it may grow while they arrive: requests
    submitted meanwhile), keyed by (request id, sample index); AssertionError when one is late (``timeout`` seconds)
    or a sample comes back twice."""
    got: dict[tuple, Completion] = {}
    while len(got) != expected():
        c = loop.get_completion(timeout=timeout)
        assert c is not None, f"{len(got)} of {expected()} completions arrived"
        assert (c.request_id, c.sample_index) not in got, "a sample came back twice"
        got[c.request_id, c.sample_index] = c
    return got


def submit_all(loop: SamplerLoop, requests: Sequence[Request]) -> None:
    """Submit ``requests`` while the loop is paused, so it starts stepping with all of them queued."""
    loop.pause()
    for r in requests:
        loop.submit(r)
    loop.resume()


@contextlib.contextmanager
def on_each_dispatch(engine: Engine, hook: Callable[[int], None]) -> Iterator[None]:
    """Call ``hook(n)`` right after ``engine`` issues its dispatch number n (0-based) of ``generate_steps``,
    while the device runs it (aborts, weight updates or submissions arriving mid-dispatch); the engine's own
    ``generate_steps`` is back afterwards."""
    dispatch, count = engine.generate_steps, itertools.count()

    def hooked(*args, **kwargs):
        out = dispatch(*args, **kwargs)
        hook(next(count))
        return out

    engine.generate_steps = hooked
    try:
        yield
    finally:
        del engine.generate_steps


def run_requests(engine: Engine, params: nnx.State, requests: Sequence[Request],
                 **loop_kwargs) -> tuple[list[Completion], dict]:
    """Submit ``requests`` to a new SamplerLoop on ``engine`` all at once (the loop paused meanwhile), collect
    every completion (sorted as :func:`collect_completions`) and the loop's final stats; stop the loop."""
    loop = SamplerLoop(engine, params, **loop_kwargs)
    submit_all(loop, requests)
    done = collect_completions(loop, sum(r.n for r in requests))
    stats = loop.stats()
    loop.stop()
    return done, stats


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``predicate`` every 2 ms until it holds; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def serve(engine: Engine, params: nnx.State, requests: Sequence[Request], timeout: float = 120.0,
          **loop_kw: object) -> list[Completion]:
    """Every sample of ``requests`` through a fresh SamplerLoop (all submitted before it starts stepping),
    sorted by (str(request id), sample index); the loop is stopped afterwards."""
    loop = SamplerLoop(engine, params, **loop_kw)
    try:
        submit_all(loop, requests)
        return collect_completions(loop, sum(r.n for r in requests), timeout=timeout)
    finally:
        loop.stop(graceful=False)


def assert_greedy_decode_is_full_forward(model: Transformer, prompts: Sequence[Sequence[int]], *, max_len: int = 32,
                                         new_tokens: int = 16, slots: int = 2, decode_steps: int = 4,
                                         page_size: int | None = None, mesh: Any = None,
                                         decode_attention: str = "auto") -> None:
    """Greedy requests of `prompts` through an Engine of `slots` slots (a PagedEngine of pages of `page_size`
    positions when given; params and cache laid out on `mesh` when given; the dense Engine's `decode_attention`)
    and a SamplerLoop (k = decode_steps) give the tokens and log-probs (within 1e-4) of greedy decoding by repeated
    full forwards."""
    from areal_jax.sampler.paged_engine import PagedEngine  # noqa: PLC0415 (only here)

    _, params = nnx.split(model)
    engine = Engine(model, num_slots=slots, max_len=max_len, mesh=mesh, decode_attention=decode_attention) \
        if page_size is None else PagedEngine(model, num_slots=slots, max_len=max_len, page_size=page_size, mesh=mesh)
    if mesh is not None:
        params = engine.place_params(params)
    done = serve(engine, params,
                 [Request(id=i, prompt=p, max_new_tokens=new_tokens, temperature=0.0) for i, p in enumerate(prompts)],
                 decode_steps=decode_steps)
    logp = full_forward_logp(model, max_len)
    for completion, prompt in zip(done, prompts):
        tokens, lps, _ = greedy_reference(logp, prompt, new_tokens)
        assert list(completion.tokens) == tokens
        np.testing.assert_allclose(completion.logprobs, lps, atol=1e-4)


class HookAfterDispatch(Engine):
    """An Engine that calls ``hook`` right after issuing dispatch number ``at`` (0-based) of
    ``generate_steps``, while the device runs it (a weight update or an abort arriving mid-dispatch)."""

    at, hook, calls = 1, None, 0

    def generate_steps(self, params, decode_state, keys, routes=False):
        out = super().generate_steps(params, decode_state, keys, routes)
        if self.calls == self.at and self.hook is not None:
            self.hook()
        self.calls += 1
        return out


def set_clock(seconds: dict[str, float], seen: list[str] | None = None) -> Callable[[str, Callable[[], Any]], float]:
    """A `sampler.decode_choice` timer that reports `seconds[name]` for INNER calls of each candidate without running
    it, appending each name it is asked for to `seen`."""
    from areal_jax.sampler import decode_choice  # noqa: PLC0415 (only here)

    def timer(name: str, run: Callable[[], Any]) -> float:
        if seen is not None:
            seen.append(name)
        return seconds[name] * decode_choice.INNER

    return timer


def mesh_across_processes() -> Any:
    """A stand-in for a 1 x 2 ("fsdp", "tensor") mesh whose second device belongs to another process, as a
    multi-host mesh holds (only what the decode-attention choices read of a mesh)."""
    class Remote:
        process_index, device_kind = 1, "remote"

    class TwoHosts:
        shape = {"fsdp": 1, "tensor": 2}
        devices = np.array([jax.devices()[0], Remote()], dtype=object).reshape(1, 2)

    return TwoHosts()


def cache_bytes_laid_out(rollout: Any, model: Transformer, mesh: Any = None) -> int:
    """Bytes per device of the decode state that `rollout`'s engine for `model` allocates for its cache (keys and
    values or pages, ring rows, stateful layers' windows and states, standby rows) and its decode logits: every leaf of
    at least two axes but the int32 tables, each as the engine lays it out on `mesh` (None: one device). What the
    memory plan (`system.memory.kv_cache_bytes`) must equal."""
    engine = rollout.make_engine(model, mesh=mesh, config=model.cfg)
    shapes = jax.eval_shape(engine._init_fn)
    parts = [(getattr(tree, part), None if mesh is None else getattr(held, part))
             for tree, held in ((shapes, getattr(engine, "_state_sharding", None)),
                                (shapes.standby, getattr(getattr(engine, "_state_sharding", None), "standby", None)))
             for part in ("cache", "logits")]
    total = 0
    for tree, layout in parts:
        leaves = jax.tree.leaves(tree)
        shardings = [None] * len(leaves) if layout is None else jax.tree.leaves(layout)
        for x, s in zip(leaves, shardings, strict=True):
            if x.ndim >= 2 and x.dtype != np.int32:
                total += x.dtype.itemsize * int(np.prod(x.shape if s is None else s.shard_shape(x.shape)))
    return total
