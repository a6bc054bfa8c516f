"""Restoring a trainer from a checkpoint saved with another ``train.moment_dtype``.

A run that ran out of memory can resume with ``--config.train.moment_dtype=bfloat16`` (and one whose bfloat16
moments should go back to float32 with ``float32``): the two optimizers' states hold the same leaves in the same order
(the step count, the first moments, the second moments, the schedule's count), in other optax nodes and dtypes. So a
checkpoint whose structure does not fit is restored as the other moment dtype's optimizer would have saved it, each
moment laid out as the one it replaces, and cast to this run's dtype on its devices: bfloat16 -> float32 exactly,
float32 -> bfloat16 rounded to nearest (once; only the repeated rounding of every step needs to be stochastic).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from areal_jax.checkpoint import Checkpointer, StateMismatch
from areal_jax.trainer.low_precision import MOMENT_DTYPES
from areal_jax.trainer.optim import make_optimizer
from areal_jax.trainer.state import TrainState


def saved_with(state: TrainState, cfg: Any, moment_dtype: str) -> TrainState | None:
    """`state`'s abstract twin (ShapeDtypeStruct leaves) as a run with `moment_dtype` would have saved it: its
    optimizer state in that optimizer's structure and dtypes, each leaf with the sharding of the leaf it stands for.
    None where the two optimizers' leaves do not pair up one to one in shape (no conversion is possible)."""
    tx = make_optimizer(dataclasses.replace(cfg, moment_dtype=moment_dtype))
    other = jax.eval_shape(tx.init, state.trainable())
    mine, theirs = jax.tree.leaves(state.opt_state), jax.tree.leaves(other)
    if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
        return None
    leaves = [jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=a.sharding) for a, b in zip(mine, theirs)]
    return dataclasses.replace(state, opt_state=jax.tree.unflatten(jax.tree.structure(other), leaves))


def cast_like(restored: TrainState, like: TrainState) -> TrainState:
    """`restored`'s optimizer state moved into `like`'s structure, each leaf cast to `like`'s dtype on its devices."""
    leaves = []
    for got, want in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(like.opt_state), strict=True):
        if got.dtype != want.dtype:
            cast = jax.jit(lambda x, d=want.dtype: x.astype(d), out_shardings=want.sharding)(got)
            got.delete()  # the old dtype's copy goes before the next leaf is cast
            got = cast
        leaves.append(got)
    return dataclasses.replace(restored, opt_state=jax.tree.unflatten(jax.tree.structure(like.opt_state), leaves))


def restore_train_state(checkpointer: Checkpointer, step: int, state: TrainState,
                        cfg: Any) -> tuple[TrainState, dict, str | None]:
    """Checkpoint `step` restored into `state`'s layout (a trainer's state under its config `cfg`).

    Returns (state, meta, note): note is None for a checkpoint of this structure, else a sentence saying which
    moment dtype it was saved with and that its moments were cast. A checkpoint that fits neither structure raises
    the StateMismatch of the first attempt (it names the keys that change the structure)."""
    try:
        restored, meta = checkpointer.restore(step, state)
        return restored, meta, None
    except StateMismatch as first:
        mismatch = first
    for dtype in MOMENT_DTYPES:
        like = None if dtype == cfg.moment_dtype else saved_with(state, cfg, dtype)
        if like is None:
            continue
        try:
            restored, meta = checkpointer.restore(step, like)
        except StateMismatch:
            continue
        note = (f"its AdamW moments were saved in {dtype} and are cast to {cfg.moment_dtype} "
                f"(train.moment_dtype={cfg.moment_dtype})")
        return cast_like(restored, state), meta, note
    raise mismatch
