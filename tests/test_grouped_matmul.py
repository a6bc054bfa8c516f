"""The grouped-matmul Pallas kernel (models.grouped_matmul, run by the Pallas interpreter on CPU) against a per-block
einsum over gathered weights, values and gradients; the expert-aligned layout it consumes (models.expert_paths.block_layout);
and the MoE "pallas" path really running the kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.grouped_matmul import grouped_matmul, supports, tile
from areal_jax.models.moe import MoE, block_layout
from areal_jax.testing.models import tiny_config


def _reference(x, w, owner, block):
    nb = owner.shape[0]
    return jnp.einsum("bik,bkn->bin", x.reshape(nb, block, -1), w[owner],
                      preferred_element_type=jnp.float32).reshape(nb * block, -1)


@pytest.mark.parametrize("k,n,block,owner", [
    (64, 48, 16, [0, 0, 2, 3, 3, 3, 4]),  # expert 1 has no rows; N = 48 tiles by 16
    (32, 128, 32, [1, 1, 1, 2]),  # experts 0, 3 and 4 empty
    (160, 32, 16, [0, 1, 2, 3, 4, 4]),  # K = 160: several K tiles of 32
])
def test_values_and_gradients_equal_a_per_block_einsum(k, n, block, owner):
    rng = np.random.default_rng(0)
    owner = jnp.asarray(owner, jnp.int32)
    x = jnp.asarray(rng.normal(size=(owner.shape[0] * block, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, k, n)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(owner.shape[0] * block, n)), jnp.float32)
    got = grouped_matmul(x, w, owner, block=block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(x, w, owner, block)), atol=2e-5, rtol=1e-5)

    def loss(f):
        return lambda xx, ww: jnp.sum(f(xx, ww) * ct)

    gx, gw = jax.grad(loss(lambda a, b: grouped_matmul(a, b, owner, block=block)), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(loss(lambda a, b: _reference(a, b, owner, block)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), atol=5e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), atol=5e-5, rtol=1e-5)
    for e in range(5):  # an expert that owns no block gets an exact zero gradient, the others a real one
        assert (float(jnp.abs(gw[e]).max()) > 0) == bool((owner == e).any())


def test_bf16_operands_accumulate_in_float32_and_outputs_take_the_asked_dtype():
    rng = np.random.default_rng(1)
    owner = jnp.asarray([0, 1, 1], jnp.int32)
    x = jnp.asarray(rng.normal(size=(48, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(2, 64, 32)), jnp.bfloat16)
    got = grouped_matmul(x, w, owner, block=16, out_dtype=jnp.float32)
    assert got.dtype == jnp.float32 and grouped_matmul(x, w, owner, block=16).dtype == jnp.bfloat16
    want = _reference(x.astype(jnp.float32), w.astype(jnp.float32), owner, 16)  # exact products of bf16 values
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-3, rtol=1e-4)
    gx, gw = jax.grad(lambda a, b: jnp.sum(grouped_matmul(a, b, owner, block=16)), argnums=(0, 1))(x, w)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16


def test_tiles_and_clear_refusals():
    assert tile(768, 128) == 128 and tile(768, 64) == 64 and tile(48, 128) == 16 and tile(40, 128) == 0
    assert supports(16, 2048, 768) and supports(128, 4096, 14336)
    assert not supports(8, 64, 64) and not supports(24, 64, 64) and not supports(16, 40, 64)
    x, w = jnp.zeros((32, 40)), jnp.zeros((2, 40, 32))
    with pytest.raises(ValueError, match="do not tile"):
        grouped_matmul(x, w, jnp.zeros(2, jnp.int32), block=16)
    with pytest.raises(ValueError, match=r"need owner of shape \(2,\)"):
        grouped_matmul(jnp.zeros((32, 64)), jnp.zeros((2, 64, 32)), jnp.zeros(3, jnp.int32), block=16)
    with pytest.raises(ValueError, match=r"expected x \[R, K\] and w \[E, K, N\]"):
        grouped_matmul(jnp.zeros((32, 64)), jnp.zeros((2, 32, 32)), jnp.zeros(2, jnp.int32), block=16)


@pytest.mark.parametrize("seed", range(4))
def test_block_layout_places_every_pair_in_its_experts_blocks(seed):
    rng = np.random.default_rng(seed)
    n, k, e, block = int(rng.integers(1, 60)), int(rng.integers(1, 4)), int(rng.integers(4, 9)), 8
    # routing without repeats per token, some experts never chosen
    experts = np.stack([rng.choice(e - 1, size=k, replace=False) for _ in range(n)]).astype(np.int32)
    row, token, owner = (np.asarray(a) for a in block_layout(jnp.asarray(experts), e, block))
    assert token.shape[0] % block == 0 and token.shape[0] >= n * k and owner.shape == (token.shape[0] // block,)
    assert (np.diff(owner) >= 0).all() and owner.min() >= 0 and owner.max() < e
    assert len(set(row.tolist())) == n * k  # one padded row per pair
    pairs = np.arange(n * k)
    np.testing.assert_array_equal(token[row], pairs // k)  # the row holds the pair's token...
    np.testing.assert_array_equal(owner[row // block], experts.reshape(-1))  # ...in a block of the pair's expert
    assert (token[np.setdiff1d(np.arange(token.shape[0]), row)] == n).all()  # every other row is padding
    for ex in range(e):  # within an expert, the pairs keep routing order
        mine = row[experts.reshape(-1) == ex]
        assert (np.diff(mine) > 0).all()


def test_the_pallas_path_runs_the_kernel_and_falls_back_where_widths_do_not_tile():
    from flax import nnx

    x = jnp.ones((1, 5, 64), jnp.float32)
    kernel = MoE(tiny_config("qwen3_moe", moe_impl="pallas"), rngs=nnx.Rngs(0))
    fallback = MoE(tiny_config("qwen3_moe", moe_impl="pallas", moe_intermediate_size=40), rngs=nnx.Rngs(0))

    def kernels(layer):
        return str(jax.make_jaxpr(lambda v: layer(v))(x)).count("pallas_call")

    assert kernels(kernel) == 3 and kernels(fallback) == 0  # gate, up, down
    blocked = MoE(tiny_config("qwen3_moe", moe_impl="blocked", moe_intermediate_size=40), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(fallback(x)), np.asarray(blocked(x)), atol=1e-6)
