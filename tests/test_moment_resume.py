"""Resuming a run with another train.moment_dtype (trainer/resume.py): the checkpoint's AdamW moments are restored in
the structure they were saved with and cast to this run's dtype.

References: the float32 moments of the saving trainer, cast by numpy-side ml_dtypes (bfloat16 round to nearest) or
widened exactly; the next update of a run resumed without conversion (the same step within bfloat16's resolution);
the params' shardings on a 2-device mesh; and a checkpoint that differs in another key still refused by name.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh

from areal_jax.checkpoint import Checkpointer, StateMismatch
from areal_jax.testing import models as testing
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig
from areal_jax.trainer.low_precision import LowPrecisionAdamState
from areal_jax.trainer.resume import restore_train_state

MODEL = testing.tiny_config(num_layers=2, vocab_size=256, dtype=jnp.float32, param_dtype=jnp.float32)


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]).reshape(n, 1), ("fsdp", "tensor"))


def _trainer(moment_dtype: str, mesh: Mesh, **changes) -> Trainer:
    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=128, moment_dtype=moment_dtype, **changes)
    return Trainer(testing.random_model(MODEL, seed=3), cfg, mesh)


def _batch(seed: int):
    return random_trajectories(8, vocab=MODEL.vocab_size, min_len=5, max_len=24, seed=seed)


def _moments(state) -> list[np.ndarray]:
    """The first and second moments' leaves as float32 numpy arrays, mu's then nu's."""
    for node in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu") and hasattr(x, "nu")):
        if hasattr(node, "mu"):
            return [np.asarray(x, np.float32) for x in jax.tree.leaves(node.mu) + jax.tree.leaves(node.nu)]
    raise AssertionError("no AdamW state")


@pytest.mark.parametrize("saved,resumed", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_a_checkpoint_resumes_with_the_other_moment_dtype(tmp_path, saved, resumed):
    mesh = _mesh(2)
    src = _trainer(saved, mesh)
    src.update(_batch(1))
    src.update(_batch(2))
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(2, src.state, {"tag": "x"})
    want_moments = _moments(src.state)

    dst = _trainer(resumed, mesh)
    state, meta, note = restore_train_state(ckpt, 2, dst.state, dst.cfg)
    assert meta == {"tag": "x"} and f"saved in {saved}" in note and f"cast to {resumed}" in note
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(src.state.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(state) == jax.tree.structure(dst.state)
    for got, want in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(dst.state.opt_state)):
        assert got.dtype == want.dtype and got.sharding == want.sharding  # laid out as this run's own
    for got, want in zip(_moments(state), want_moments):
        if resumed == "bfloat16":  # rounded to nearest once
            want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
        assert np.array_equal(got, want)  # float32 <- bfloat16: exact
    counts = [int(x) for x in jax.tree.leaves(state.opt_state) if x.ndim == 0]
    assert counts and all(c == 2 for c in counts)  # Adam's and the schedule's step counts carried over
    if resumed == "bfloat16":
        assert any(isinstance(s, LowPrecisionAdamState) for s in state.opt_state)

    # The next update from the converted state takes (nearly) the step the saving run would have taken.
    dst.restore(state, meta)
    dst.update(_batch(3))
    src.update(_batch(3))
    got = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(dst.state.params))]
    ref = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(src.state.params))]
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(got, ref))
    assert worst < 1e-3 * 0.05  # lr 1e-3: the step agrees to within 5% of its size
    ckpt.close()


def test_a_checkpoint_of_the_same_dtype_needs_no_note_and_other_keys_are_still_refused(tmp_path):
    mesh = _mesh(1)
    src = _trainer("float32", mesh)
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(0, src.state, {})
    state, _, note = restore_train_state(ckpt, 0, src.state, src.cfg)
    assert note is None and jax.tree.structure(state) == jax.tree.structure(src.state)
    for dtype in ("float32", "bfloat16"):  # no clipping state: neither moment dtype's structure fits
        other = _trainer(dtype, mesh, max_grad_norm=None)
        with pytest.raises(StateMismatch, match="train.max_grad_norm"):
            restore_train_state(ckpt, 0, other.state, other.cfg)
    ckpt.close()
