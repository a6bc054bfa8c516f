"""Helpers for tests across the project: tiny configs, randomly initialised models and HF checkpoints."""
from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Transformer
from areal_jax.testing.tiny_configs import tiny_config, wide_hybrid_config  # noqa: F401 (re-exported)


def randomize_params(model: Transformer, seed: int = 0) -> Transformer:
    """Re-draws every parameter in place so that activations are O(1) and outputs are far from uniform.

    Projections (and each expert's): N(0, 1/fan_in); embedding: N(0, 1); norm scales: 1 + N(0, 0.1); biases: N(0, 0.1).
    """
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = []
    for key, (path, leaf) in zip(keys, leaves):
        names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        name = next(n for n in reversed(names) if isinstance(n, str) and n != "value")
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        if name == "scale":
            value = 1.0 + 0.1 * noise
        elif name.endswith("_bias") or name == "bias":
            value = 0.1 * noise
        elif name == "embedding":
            value = noise
        elif name.startswith("xielu_"):  # Apertus' activation scalars: alpha_p, alpha_n moved, beta and eps as they are
            value = leaf + (0.3 * noise if "alpha" in name else 0.0)
        elif name.startswith("experts_"):  # [E, in, out]
            value = noise / jnp.sqrt(leaf.shape[1])
        elif name == "o_proj":
            value = noise / jnp.sqrt(leaf.shape[0] * leaf.shape[1])
        else:
            value = noise / jnp.sqrt(leaf.shape[0])
        new.append(value.astype(leaf.dtype))
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))
    return model


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A Transformer for `cfg` with O(1)-scale random parameters (see `randomize_params`)."""
    return randomize_params(Transformer(cfg, rngs=nnx.Rngs(seed)), seed)


def temper_logits(model: Transformer, entropy: float, *, seed: int = 0, num_tokens: int = 1024,
                  sampled_rows: int = 32, rounds: int = 3) -> float:
    """Scales the final norm in place so that the model's mean next-token entropy along its own samples is `entropy`
    nats; returns the factor. `randomize_params` leaves the logits so peaked (a tied embedding's logits have a spread
    of ~sqrt(hidden_size)) that samples at temperature 1 repeat each other: the n samples of a group come out the
    same, and a reward of their text cannot tell them apart. Scaling the final norm scales every logit before any
    soft cap, so the entropy falls as the factor grows; the factor is found first by bisection over `num_tokens`
    random tokens (rows of 128), then `rounds` times by regula falsi (none when `sampled_rows` is 0) over what the
    model draws at the factor found so far: `sampled_rows` rows of 112 tokens at temperature 1 after random prompts of 16 (one sampled
    row's entropy ranges over 0.7-2.3 nats at the tiny configs, hence many rows). What a sampler of the model meets
    differs from random text: tempered on random tokens alone, the tiny configs' own samples carried 0.74 / 0.85
    nats where 1.5 was asked (the loop benchmark's 0.7 where 1.0 was); after three rounds, 1.48 / 1.40.
    Three sampling passes and a few vocabulary projections of their states each."""
    from areal_jax.models.transformer import init_cache  # noqa: PLC0415 (only here)

    cfg = model.cfg
    if not 0 < entropy < np.log(cfg.vocab_size):
        raise ValueError(f"entropy={entropy} nats must lie in (0, log(vocab_size)={np.log(cfg.vocab_size):.3f}).")
    rows = max(1, num_tokens // 128)  # rows of 128 tokens: the entropy also depends on the context's length
    length = num_tokens // rows
    prompt = min(16, length - 1)
    graphdef, state = nnx.split(model)

    def entropies(m: Transformer, h: jax.Array, log_c: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = m.unembed(h * jnp.exp(log_c).astype(h.dtype)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return logp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    @jax.jit
    def over_tokens(state: nnx.State, h: jax.Array, log_c: jax.Array) -> jax.Array:
        return jnp.mean(entropies(nnx.merge(graphdef, state), h, log_c)[1])

    @jax.jit
    def samples(state: nnx.State, prompts: jax.Array, log_c: jax.Array, key: jax.Array) -> jax.Array:
        """[rows, length] tokens: `prompts`, then the model's draws at temperature 1 (KV cache)."""
        m = nnx.merge(graphdef, state)
        rows = prompts.shape[0]
        at = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (rows, prompt))
        h, cache = m.hidden(prompts, at, cache=init_cache(cfg, rows, length))
        tokens = jnp.zeros((rows, length), jnp.int32).at[:, :prompt].set(prompts)

        def step(t, carry):
            tokens, cache, h, key = carry
            key, draw = jax.random.split(key)
            logp = entropies(m, h, log_c)[0][:, -1]
            new = jax.random.categorical(draw, logp).astype(jnp.int32)
            h, cache = m.hidden(new[:, None], jnp.full((rows, 1), t, jnp.int32), cache=cache)
            return tokens.at[:, t].set(new), cache, h, key

        return jax.lax.fori_loop(prompt, length, step, (tokens, cache, h[:, -1:], key))[0]

    def bisect(h: jax.Array, lo: float, hi: float, steps: int = 24) -> float:
        for _ in range(steps):  # the entropy falls as the factor grows
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if float(over_tokens(state, h, jnp.float32(mid))) > entropy else (lo, mid)
        return 0.5 * (lo + hi)

    def falsi(h: jax.Array, lo: float, hi: float, tol: float = 1e-3) -> float:
        """The root of entropy(log factor) - `entropy` in [lo, hi] by regula falsi (Illinois): a few evaluations
        of the vocabulary projection where bisection takes twenty (each costs a second at 0.5B on a CPU)."""
        f = lambda x: float(over_tokens(state, h, jnp.float32(x))) - entropy  # noqa: E731 (falls as x grows)
        f_lo, f_hi = f(lo), f(hi)
        if f_lo <= 0 or f_hi >= 0:  # the root lies outside: take the nearer end
            return lo if f_lo <= 0 else hi
        side = 0
        for _ in range(30):
            x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
            fx = f(x)
            if abs(fx) < tol:
                return x
            if fx > 0:
                lo, f_lo = x, fx
                f_hi, side = (f_hi / 2, -1) if side == -1 else (f_hi, -1)
            else:
                hi, f_hi = x, fx
                f_lo, side = (f_lo / 2, 1) if side == 1 else (f_lo, 1)
        return x

    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, length)), jnp.int32)
    log_c = bisect(model.hidden(tokens), np.log(1e-4), np.log(1e4))  # to a millionth of the factor
    prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (sampled_rows, prompt)), jnp.int32)
    for r in range(rounds if sampled_rows else 0):  # along what the model draws at the factor found so far
        drawn = samples(state, prompts, jnp.float32(log_c), jax.random.key(seed * 7919 + r))
        log_c = falsi(model.hidden(drawn)[:, prompt - 1:-1], log_c - np.log(8), log_c + np.log(8))
    factor = float(np.exp(log_c))
    scale = model.final_norm.scale
    one = 1.0 if model.final_norm.offset else 0.0  # Gemma stores the norm's factor as its offset from one
    scale[...] = ((scale[...].astype(jnp.float32) + one) * factor - one).astype(scale[...].dtype)
    return factor


def write_random_hf_checkpoint(path: str | os.PathLike, cfg: ModelConfig, seed: int = 0,
                               max_shard_size: int | None = None, entropy: float | None = None,
                               temper_rows: int = 32) -> Transformer:
    """Builds `random_model(cfg, seed)`, saves it as an HF checkpoint directory at `path`, returns the model.

    No torch needed. max_shard_size (bytes) splits the weights into model-*.safetensors with an index file.
    entropy: the mean next-token entropy (nats) the logits are tempered to (`temper_logits`, along `temper_rows`
    rows of the model's own samples); None leaves them.
    """
    from areal_jax.models.hf_io import save_hf_checkpoint

    model = random_model(cfg, seed)
    if entropy is not None:
        temper_logits(model, entropy, seed=seed, sampled_rows=temper_rows)
    save_hf_checkpoint(model, path, max_shard_size=max_shard_size)
    return model


def assert_sharded_forward_matches_one_device(cfg: ModelConfig, mesh: Any, split: Any = None) -> None:
    """On `mesh` (fsdp, tensor axes), a model of `cfg` with its parameters laid out by their logical axes: the
    cache-free forward over packed rows (two segments a row), its gradients and the cache path equal one device's
    (float32 sums split over devices: gradients within 2e-4 relative, 1e-4 of their largest; logits within 1e-4).
    split(model): the parameter that must be spread over every device of the mesh (checked)."""
    from areal_jax.models import init_cache, shard_params  # noqa: PLC0415

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 20)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 12 + [2] * 8], 4, axis=0), jnp.int32)
    pos = jnp.asarray(np.repeat([list(range(12)) + list(range(8))], 4, axis=0), jnp.int32)

    def loss(model):
        return jnp.sum(jnp.tanh(model(tokens, pos, seg)))

    reference = random_model(cfg, seed=5)
    want, want_grads = loss(reference), nnx.grad(loss)(reference)
    model = shard_params(random_model(cfg, seed=5), mesh)
    if split is not None:
        assert len(split(model)[...].sharding.device_set) == mesh.size
    graphdef, state = nnx.split(model)
    got, grads = jax.jit(jax.value_and_grad(lambda st: loss(nnx.merge(graphdef, st))))(state)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(want_grads)), jax.tree.leaves(grads)):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=1e-4 * float(jnp.abs(a).max()))
    decode = jax.jit(lambda st, t, p, c: nnx.merge(graphdef, st)(t, p, cache=c))
    logits, _ = decode(state, tokens[:, :12], pos[:, :12], init_cache(cfg, 4, 16))
    np.testing.assert_allclose(logits, reference(tokens[:, :12]), atol=1e-4, rtol=1e-5)
