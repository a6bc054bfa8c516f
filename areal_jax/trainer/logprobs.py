"""Per-token log-probs, entropies (and critic values) without a full [tokens, vocab] logits array.

The vocabulary projection runs over chunks of the token axis (`lax.map`); each chunk's backward
(`logits_logp_entropy`) recomputes that chunk's logits instead of storing them. At any time only one
[B, chunk, vocab] float32 block of logits is alive, forward or backward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.layers import soft_cap
from areal_jax.models.transformer import logits_divisor


def _logits(h: jax.Array, w: jax.Array, softcap: float | None, scaling: float | None = None,
            bias: jax.Array | None = None) -> jax.Array:
    """Rows h [N, D] against w [D, V]: float32 logits, plus `bias` [V] (PhiMoE's lm_head bias), divided by `scaling`
    (Granite's logits_scaling) and then soft-capped (Gemma 2) where those are set."""
    logits = jnp.matmul(h, w, preferred_element_type=jnp.float32)
    logits = logits if bias is None else logits + bias.astype(jnp.float32)
    return soft_cap(logits if scaling is None else logits / np.float32(scaling), softcap)


def _chunk_forward(h: jax.Array, w: jax.Array, targets: jax.Array, with_entropy: bool,
                   softcap: float | None = None, scaling: float | None = None,
                   bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logp, entropy, lse) of rows h [N, D] against w [D, V] (float32 logits, never returned)."""
    logits = _logits(h, w, softcap, scaling, bias)
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    if not with_entropy:
        return logp, jnp.zeros_like(logp), lse
    finite = jnp.where(jnp.isfinite(logits), logits, 0.0)
    ent = lse - jnp.sum(jnp.exp(logits - lse[:, None]) * finite, axis=-1)
    return logp, ent, lse


def _rows(x: jax.Array) -> jax.Array:
    """[B, c, ...] -> [B * c, ...]: one 2-D matrix product per chunk (see models.layers.dense: XLA:CPU's
    backward then needs no transposing copies)."""
    return x.reshape((-1,) + x.shape[2:])


def _forward_chunks(h, w, targets, with_entropy, softcap=None, scaling=None, bias=None):
    def one(args):
        h_c, t_c = args
        return tuple(x.reshape(t_c.shape)
                     for x in _chunk_forward(_rows(h_c), w, _rows(t_c), with_entropy, softcap, scaling, bias))

    return jax.lax.map(one, (h, targets))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def logits_logp_entropy(h: jax.Array, w: jax.Array, targets: jax.Array, with_entropy: bool = True,
                        softcap: float | None = None, scaling: float | None = None,
                        bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """log softmax(h @ w)[targets] and the entropy of softmax(h @ w) over chunks, without keeping any logits.

    h: [n, B, c, D] (n chunks of B rows x c positions) and w: [D, V] in the compute dtype; targets: [n, B, c]
    int32. Returns (logp, entropy), [n, B, c] float32 each (entropy zeros when ``with_entropy`` is False).
    The chunks run one after another (``lax.map``), so one chunk's float32 logits are alive at a time.

    The backward is written out instead of left to autodiff (which, under ``jax.checkpoint``, recomputed the
    whole forward, the entropy included): per chunk it recomputes the logits once, forms d(loss)/d(logits) =
    g_logp * (onehot(t) - p) - g_ent * p * (logits - lse + H) in one elementwise pass (p = exp(logits - lse);
    lse and H saved by the forward), casts it to the operands' dtype and runs the two products, summing
    w's gradient over the chunks in float32. In float32 compute the cast is a no-op; in bf16 the products
    take bf16 operands with float32 accumulation (PyTorch autocast's precision) instead of being promoted to
    float32 by the float32 cotangent (at the Qwen2.5-0.5B shape on an H200 the promoted products were 21% of
    an update's kernel time). The entropy's gradient assumes finite logits (true of a matrix product).
    softcap: the logits are Gemma 2's softcap * tanh((h @ w) / softcap); the backward then multiplies
    d(loss)/d(logits) by 1 - tanh^2 before the products. scaling: the logits are (h @ w) / scaling (Granite's
    logits_scaling, before any cap); the backward divides by it too. bias: [V] added to h @ w first (PhiMoE's
    lm_head bias; None: none); its gradient is d(loss)/d(logits) summed over the rows, in float32.
    """
    logp, ent, _ = _forward_chunks(h, w, targets, with_entropy, softcap, scaling, bias)
    return logp, ent


def _lpe_fwd(h, w, targets, with_entropy, softcap, scaling, bias):
    logp, ent, lse = _forward_chunks(h, w, targets, with_entropy, softcap, scaling, bias)
    return (logp, ent), (h, w, targets, lse, ent, bias)


def _lpe_bwd(with_entropy, softcap, scaling, res, g):
    h, w, targets, lse, ent, bias = res
    g_logp, g_ent = g

    def one(carry, xs):
        dw, db = carry
        h_c, t_c, lse_c, ent_c, gl_c, ge_c = (_rows(x) for x in xs)
        logits = _logits(h_c, w, softcap, scaling, bias)
        centred = logits - lse_c[:, None]
        p = jnp.exp(centred)
        onehot = jnp.arange(logits.shape[-1], dtype=t_c.dtype)[None, :] == t_c[:, None]
        dlogits = jnp.where(onehot, gl_c[:, None], 0.0) - p * gl_c[:, None]
        if with_entropy:
            dlogits = dlogits - ge_c[:, None] * p * (centred + ent_c[:, None])
        if softcap is not None:
            dlogits = dlogits * (1.0 - jnp.square(logits / np.float32(softcap)))
        if scaling is not None:
            dlogits = dlogits / np.float32(scaling)
        db = None if bias is None else db + jnp.sum(dlogits, axis=0)
        dlogits = dlogits.astype(h.dtype)
        dh_c = jnp.matmul(dlogits, w.T, preferred_element_type=jnp.float32).astype(h.dtype)
        dw = dw + jnp.matmul(h_c.T, dlogits, preferred_element_type=jnp.float32)
        return (dw, db), dh_c.reshape(xs[0].shape)

    db0 = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    (dw, db), dh = jax.lax.scan(one, (jnp.zeros(w.shape, jnp.float32), db0), (h, targets, lse, ent, g_logp, g_ent))
    return dh, dw.astype(w.dtype), None, None if bias is None else db.astype(bias.dtype)


logits_logp_entropy.defvjp(_lpe_fwd, _lpe_bwd)


def chunked_logprobs(
    h: jax.Array, unembed: jax.Array, targets: jax.Array, chunk: int, *, with_entropy: bool = True,
    softcap: float | None = None, scaling: float | None = None, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target token and the entropy of each next-token distribution.

    Args:
      h: [B, T, D] hidden states after the final norm (compute dtype).
      unembed: [D, V] the unembedding matrix (cast to h's dtype; logits accumulate in float32).
      targets: [B, T] int32, the token whose log-prob is wanted at each position.
      chunk: tokens per chunk of the T axis (T is padded up to a multiple internally).
      with_entropy: False skips the entropy (returns zeros), saving one pass over the chunk's logits.
      softcap: Gemma 2's final-logit soft-capping (ModelConfig.final_logit_softcap).
      scaling: Granite's logits divisor (ModelConfig.logits_scaling).
      bias: [V] the logits' bias (PhiMoE's lm_head bias), or None.
    Returns:
      logp: [B, T] float32, log softmax(h @ unembed)[targets].
      entropy: [B, T] float32.
    """
    b, t, d = h.shape
    c = max(1, min(chunk, t))
    n = -(-t // c)
    pad = n * c - t
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # Chunk axis first, batch axis kept whole so its data-parallel sharding is untouched.
    h_chunks = h.reshape(b, n, c, d).transpose(1, 0, 2, 3)
    t_chunks = targets.reshape(b, n, c).transpose(1, 0, 2).astype(jnp.int32)
    logp, ent = logits_logp_entropy(h_chunks, unembed.astype(h.dtype), t_chunks, with_entropy, softcap, scaling, bias)
    logp = logp.transpose(1, 0, 2).reshape(b, n * c)[:, :t]
    ent = ent.transpose(1, 0, 2).reshape(b, n * c)[:, :t]
    return logp, ent


def init_value_head(hidden_size: int) -> dict[str, jax.Array]:
    """A zero-initialised value head (Linear hidden_size -> 1, float32): {"kernel": [D, 1], "bias": [1]}.

    Zeros make the first values 0, so the first update's GAE targets are the discounted rewards."""
    return {"kernel": jnp.zeros((hidden_size, 1), jnp.float32), "bias": jnp.zeros((1,), jnp.float32)}


def apply_value_head(head: dict[str, jax.Array], h: jax.Array) -> jax.Array:
    """Values V(s_t) = h_t @ kernel + bias in float32. h: [B, T, D] any float dtype. Returns [B, T] float32."""
    d = h.shape[-1]
    v = jnp.matmul(h.reshape(-1, d).astype(jnp.float32), head["kernel"], preferred_element_type=jnp.float32)
    return v.reshape(h.shape[:-1]) + head["bias"][0]


def model_outputs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    other: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    targets: jax.Array,
    chunk: int,
    *,
    value_head: dict[str, jax.Array] | None = None,
    with_entropy: bool = True,
    attention: str = "auto",
    remat: str = "none",
    scan_layers: bool = False,
    router_stats: bool = False,
    routes: jax.Array | None = None,
    replay: bool = False,
) -> tuple[jax.Array, ...]:
    """model_logprobs plus the value head on the same trunk: (logp, entropy, values), each [B, T]
    float32; values is None without a value head. Position p's value is that of the state scoring
    token p + 1 (aligned with logp). routes [B, T, L_moe, k], replay: the mixture-of-experts layers' given
    experts (`Transformer.hidden`). router_stats: a fourth output, those layers' extras ("stats"
    `models.moe.router_stats` [L_moe, 2, E] over the real tokens; "agree" [L_moe] with routes; None for a dense
    model)."""
    model = nnx.merge(graphdef, params, other)
    h = model.hidden(tokens, positions, segment_ids, attention=attention, remat=remat, scan_layers=scan_layers,
                     router_stats=router_stats, routes=routes, replay=replay)
    h, stats = h if router_stats else (h, None)
    logp, ent = chunked_logprobs(h, model.unembed_matrix(), targets, chunk, with_entropy=with_entropy,
                                 softcap=model.cfg.final_logit_softcap, scaling=logits_divisor(model.cfg),
                                 bias=model.unembed_bias())
    values = None if value_head is None else apply_value_head(value_head, h)
    return (logp, ent, values, stats) if router_stats else (logp, ent, values)


def model_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    other: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    targets: jax.Array,
    chunk: int,
    *,
    with_entropy: bool = True,
    attention: str = "auto",
    remat: str = "none",
) -> tuple[jax.Array, jax.Array]:
    """Run the model on packed rows and return (logp, entropy), both [B, T] float32.

    tokens, positions, segment_ids, targets: [B, T] int32 in the packed layout (segment id 0 is padding;
    values at padding positions are meaningless and must be masked by the caller). attention, remat:
    the training forward's choices (TrainerConfig.attention / .remat, models.packed_attention).
    """
    logp, ent, _ = model_outputs(graphdef, params, other, tokens, positions, segment_ids, targets, chunk,
                                 with_entropy=with_entropy, attention=attention, remat=remat)
    return logp, ent
