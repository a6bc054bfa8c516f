"""Compiling the update's programs before the first batch arrives (`Trainer.warm_up`).

A job's first update waits for its first batch, then traces and compiles its forward, gradient-accumulation and
optimizer programs before it computes anything. The shape most minibatches can take is known from the config
alone: rows of `layout.row_length(longest)` for the longest trajectory the sampler can return, as many as
micro_batch_tokens holds. Compiling the programs of that shape while the start evaluation and the first rollouts
run takes the compile off the trainer's path: on an accelerator the compile is host work beside device work; on
a CPU it shares the cores. The shape goes into the trainer's `layout.ShapeBook` at once (deterministically, on
every process), so packing treats it as compiled from the first minibatch on.

The programs are lowered from abstract values (shapes, dtypes, shardings) taken when the warm-up starts, so an
update that donates the trainer's arrays meanwhile cannot race with it; `jit(...).lower(...).compile()` fills the
same cache the update's calls then hit.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp

from areal_jax.trainer import layout
from areal_jax.trainer.memory import abstract, accumulator_specs, batch_structs
from areal_jax.trainer.state import replicated
from areal_jax.trainer.update import model_fields


def seed_shape(longest: int, budget: int) -> tuple[int, int]:
    """(row length, rows per device) of the shape a warm-up compiles: rows that hold `longest` packed tokens, as
    many as the budget holds."""
    row_len = layout.row_length(longest, budget)
    return row_len, max(1, budget // row_len)


def compile_thunks(trainer, row_len: int, per_device: int) -> list[Callable[[], Any]]:
    """One thunk per program an update with micro-steps of this shape runs, each compiling it; the values
    they lower with are abstracted now."""
    cfg, fns = trainer.cfg, trainer._fns
    rep = replicated(trainer.mesh)
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=rep)  # noqa: E731
    state = abstract(trainer.state)
    train, other = state.trainable(), abstract(trainer._other)
    grads = accumulator_specs(train)
    sums = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), jax.eval_shape(fns.zero_metrics))
    rows = trainer.n_devices * per_device
    batch = batch_structs(cfg, rows, row_len, fns.batch_sharding, trainer._model_cfg)
    thunks = []
    if cfg.recomputes_prox or cfg.critic == "value_head" or cfg.kl_coef > 0:  # a forward before the micro-steps
        model_inputs = {k: batch[k] for k in model_fields(cfg)}
        thunks.append(lambda: fns.forward.lower(train, other, model_inputs).compile())
    thunks += [
        lambda: fns.zero_grads.lower(train).compile(),
        lambda: fns.zero_metrics.lower().compile(),
        lambda: fns.accumulate.lower(train, other, grads, sums, batch, scalar(jnp.int32)).compile(),
    ]
    applies = [fns.apply]  # with a sampler copy kept, the step that ends an update is apply_cast's (trainer.publish)
    if trainer._copy is not None:
        applies = applies[: cfg.ppo_minibatches > 1] + [fns.apply_cast(*trainer._copy.step_key)]
    thunks += [lambda fn=fn: fn.lower(state, grads, sums, scalar(jnp.float32), scalar(jnp.int32)).compile()
               for fn in applies]
    return thunks


def warm_up(trainer, longest: int, background: bool = False, log: Callable[[str], None] | None = None
            ) -> threading.Thread | None:
    """Record `seed_shape(longest, budget)` as compiled in trainer.layouts and compile its programs, here or in a
    daemon thread (returned). A failed background compile is logged and left to the update, which compiles what
    it needs anyway."""
    shape = seed_shape(longest, trainer.cfg.micro_batch_tokens)
    trainer.layouts.compiled.add(shape)
    thunks = compile_thunks(trainer, *shape)
    if not background:
        for thunk in thunks:
            thunk()
        return None

    def run():
        try:
            for thunk in thunks:
                thunk()
        except Exception as e:  # noqa: BLE001 - the update compiles what is missing
            if log is not None:
                log(f"Compiling the update ahead of the first batch failed ({e!r}); the first update compiles it.")

    thread = threading.Thread(target=run, name="trainer-warm-up", daemon=True)
    thread.start()
    return thread
