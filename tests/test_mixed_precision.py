"""Mixed precision (model.dtype=bfloat16, model.param_dtype=float32): float32 master params and optimizer
state, bfloat16 matmuls, float32 log-softmax and loss."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.testing import models as testing
from areal_jax.trainer import Trainer, TrainerConfig, Trajectory
from areal_jax.trainer.logprobs import model_logprobs


def bf16_model():
    cfg = testing.tiny_config("qwen2", dtype=jnp.bfloat16, param_dtype=jnp.float32, vocab_size=211)
    return testing.random_model(cfg, seed=0)


def trajectories(vocab, n=6):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        p, c = int(rng.integers(3, 9)), int(rng.integers(4, 20))
        out.append(Trajectory(tokens=rng.integers(3, vocab, p + c), prompt_len=p,
                              behav_logp=rng.normal(-np.log(vocab), 0.1, c), versions=np.zeros(c, np.int32),
                              advantage=float(rng.normal())))
    return out


def test_bf16_compute_keeps_float32_params_and_optimizer_state():
    model = bf16_model()
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    trainer = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_tokens=64), mesh)
    before = jax.tree.map(np.asarray, trainer.state.params)
    trainer.update(trajectories(model.cfg.vocab_size))
    params = jax.tree.leaves(trainer.state.params)
    moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if getattr(x, "ndim", 0) > 0]
    assert params and all(x.dtype == jnp.float32 for x in params)
    assert len(moments) == 2 * len(params) and all(x.dtype == jnp.float32 for x in moments)
    # The masters keep steps a bfloat16 copy would round away: some weights moved by less than half a
    # bfloat16 ulp of their value (lr 1e-3 against weights of magnitude ~0.02-1).
    sub_ulp = 0
    for new, old in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(before)):
        new, old = np.asarray(new), np.asarray(old)
        moved = (new != old) & (old != 0)
        half_ulp = np.exp2(np.floor(np.log2(np.abs(np.where(old == 0, 1.0, old)))) - 8)
        sub_ulp += int(np.sum(moved & (np.abs(new - old) < half_ulp)))
    assert sub_ulp > 0


def test_bf16_logprobs_are_a_float32_log_softmax_of_bf16_logits():
    # The logits come from bfloat16 hidden states and weights with float32 accumulation; their
    # log-softmax must then be float32: compare with float64 arithmetic on the same bfloat16 inputs.
    model = bf16_model()
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 211, (2, 24)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    seg = jnp.ones((2, 24), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    logp, _ = model_logprobs(graphdef, params, other, tokens, pos, seg, targets, 8)
    assert logp.dtype == jnp.float32
    h = model.hidden(tokens, pos, seg)
    assert h.dtype == jnp.bfloat16
    w = model.unembed_matrix().astype(jnp.bfloat16)
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)  # exact products of bf16 values
    shift = logits.max(-1, keepdims=True)
    ref = logits - shift - np.log(np.exp(logits - shift).sum(-1, keepdims=True))
    ref = np.take_along_axis(ref, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logp), ref, atol=2e-5)  # bf16 softmax would be ~1e-2 off


def test_bf16_training_gradients_are_float32():
    model = bf16_model()
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 211, (1, 16)), jnp.int32)
    pos = jnp.arange(16, dtype=jnp.int32)[None]
    seg = jnp.ones((1, 16), jnp.int32)

    def loss(p):
        logp, _ = model_logprobs(graphdef, p, other, tokens, pos, seg, jnp.roll(tokens, -1, axis=1), 8)
        return -jnp.mean(logp)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert value.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_a_bf16_model_decodes_over_a_float32_cache_on_the_cpu():
    """XLA:CPU converts a 16-bit cache around every scatter and read, so on the CPU the cache holds float32 (the
    bf16 keys and values exactly); elsewhere it holds the compute dtype. Greedy decoding over it matches the
    model's own bf16 forward passes without a cache, token for token."""
    from areal_jax.models.transformer import cache_dtype
    from areal_jax.sampler import SamplingParams
    from areal_jax.sampler.engine import Engine
    from areal_jax.sampler.paged_engine import PagedEngine
    from areal_jax.testing.sampler import full_forward_logp, greedy_reference

    model = bf16_model()
    assert cache_dtype(model.cfg, "cpu") == jnp.float32 and cache_dtype(model.cfg, "gpu") == jnp.bfloat16
    assert cache_dtype(testing.tiny_config("qwen2"), "cpu") == jnp.float32  # float32 models: unchanged
    _, params = nnx.split(model)
    logp = full_forward_logp(model, 48)
    prompts = [[5, 9, 13, 2], [7, 7, 30, 41, 2, 8, 19], [100]]
    for engine in (Engine(model, num_slots=3, max_len=48), PagedEngine(model, num_slots=3, max_len=48, page_size=8)):
        state = engine.init_decode_state()
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.cache) if x.dtype != jnp.int32)
        state = engine.insert_sequences(params, state, [0, 1, 2], prompts,
                                        [SamplingParams(temperature=0.0, max_new_tokens=12)] * 3)
        got = [[] for _ in prompts]
        for step in range(12):
            state, result = engine.generate(params, state, jax.random.key(step))
            r = result.to_host()
            for slot in range(3):
                got[slot].append(int(r.tokens[slot]))
        for prompt, tokens in zip(prompts, got):
            assert tokens == greedy_reference(logp, prompt, 12)[0]
