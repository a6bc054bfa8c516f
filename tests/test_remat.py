"""Per-layer rematerialisation (train.remat): same gradients as none, less memory held for the backward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import config as config_lib
from areal_jax.testing import models as testing
from areal_jax.trainer import TrainerConfig
from areal_jax.trainer.logprobs import model_logprobs


def packed_rows(rng, b, t, vocab):
    """tokens, positions, segment ids (3-4 sequences per row, trailing padding = 0), targets."""
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    seg = np.zeros((b, t), np.int32)
    pos = np.zeros((b, t), np.int32)
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(4, t - 6), size=3, replace=False))
        start = 0
        for i, end in enumerate([*cuts, t - 3]):
            seg[r, start:end] = i + 1
            pos[r, start:end] = np.arange(end - start)
            start = end
    return tokens, pos, seg, np.roll(tokens, -1, axis=1)


def loss_and_grads(remat, attention="dense", dtype=jnp.float32, t=40):
    cfg = testing.tiny_config("qwen2", num_layers=3, dtype=dtype)
    model = testing.random_model(cfg, seed=1)
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    tokens, pos, seg, tgt = (jnp.asarray(x) for x in packed_rows(rng, 2, t, cfg.vocab_size))
    weights = jnp.asarray(rng.normal(size=(2, t)), jnp.float32) * (seg > 0)

    def loss(p):
        logp, ent = model_logprobs(graphdef, p, other, tokens, pos, seg, tgt, 16, attention=attention, remat=remat)
        return jnp.sum(weights * logp) + 0.1 * jnp.sum(weights * ent)

    return jax.jit(jax.value_and_grad(loss))(params), (graphdef, params, other, tokens, pos, seg, tgt, loss)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_policies_give_the_gradients_of_none(remat):
    (ref_loss, ref_grads), _ = loss_and_grads("none")
    (loss, grads), _ = loss_and_grads(remat)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    ref_leaves, leaves = jax.tree.leaves(ref_grads), jax.tree.leaves(grads)
    assert len(ref_leaves) == len(leaves) > 10
    for a, b in zip(ref_leaves, leaves):
        # float32: recomputation reorders a few sums; allow 1e-5 of each gradient's largest entry
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


def test_remat_with_blocked_attention_gives_the_gradients_of_none():
    # 384-token rows take the blocked path on the CPU (lax.cond per block pair inside the checkpoint).
    (ref_loss, ref_grads), _ = loss_and_grads("none", attention="blocked", t=384)
    (loss, grads), _ = loss_and_grads("full", attention="blocked", t=384)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
        # float32: recomputation reorders a few sums; allow 1e-5 of each gradient's largest entry
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


def test_remat_keeps_less_for_the_backward():
    # What the forward hands to the backward (the leaves of jax.vjp's closure): with
    # "full" only each layer's input (plus the non-layer parts), with "dots" also the projections' outputs.
    # (XLA:CPU's compiled memory estimate cannot show this: it drops the recomputation's optimisation
    # barriers and merges the recomputed matmuls with the forward's; GPU and TPU compilers keep them.)
    cfg = testing.tiny_config("qwen2", num_layers=6, hidden_size=64, intermediate_size=256)
    model = testing.random_model(cfg, seed=0)
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    rows = tuple(jnp.asarray(x) for x in packed_rows(rng, 2, 256, cfg.vocab_size))

    def saved_bytes(remat):
        def loss(p):
            return jnp.sum(model_logprobs(graphdef, p, other, *rows, 64, attention="dense", remat=remat)[0])

        # the vjp closure's leaves are exactly what the backward reads; shapes only, nothing computed
        residuals = jax.eval_shape(lambda p: jax.tree.leaves(jax.vjp(loss, p)[1]), params)
        return sum(r.size * r.dtype.itemsize for r in residuals)

    none, full, dots = saved_bytes("none"), saved_bytes("full"), saved_bytes("dots")
    x_bytes = 2 * 256 * cfg.hidden_size * 4  # one layer input, float32
    scores = 2 * cfg.num_heads * 256 * 256 * 4  # one layer's attention probabilities
    assert none > 6 * scores  # without remat every layer keeps its [T, T] probabilities
    assert full < none / 5 and full < 6 * x_bytes + 3 * scores  # layer inputs and the mask, no per-layer scores
    assert full < dots < none


def test_bad_remat_and_attention_values_are_rejected_before_compiling():
    with pytest.raises(ValueError, match="remat='layer' is not one of auto, none, full, dots"):
        TrainerConfig(remat="layer")
    with pytest.raises(ValueError, match="attention='cudnn' is not one of auto, dense, blocked, flash"):
        TrainerConfig(attention="cudnn")
    c = config_lib.base_config()
    c.train.remat = "all"
    with pytest.raises(config_lib.ConfigError, match="train.remat='all'"):
        config_lib.validate(c, check_paths=False)
    c = config_lib.base_config()
    c.train.attention = "splash"
    with pytest.raises(config_lib.ConfigError, match="train.attention='splash'"):
        config_lib.validate(c, check_paths=False)
