"""Per-token log-probs, entropies (and critic values) without a full [tokens, vocab] logits array.

The vocabulary projection runs over chunks of the token axis (`lax.map`); each chunk is wrapped in
`jax.checkpoint`, so the backward pass recomputes that chunk's logits instead of storing them. At any
time only one [B, chunk, vocab] float32 block of logits is alive, forward or backward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.rl.losses import token_entropy, token_logprobs


@jax.custom_vjp
def logits_matmul(h: jax.Array, w: jax.Array) -> jax.Array:
    """[N, D] @ [D, V] -> [N, V] float32 logits from operands in the compute dtype.

    The same product as `jnp.matmul(h, w, preferred_element_type=float32)`, but its backward casts the
    float32 cotangent to the operands' dtype before the two backward products. Left to autodiff, a
    float32 cotangent promotes both backward matmuls to float32 (tf32 on a GPU): at the Qwen2.5-0.5B
    shape on an H200 those two products were 21% of an update's kernel time. In float32 compute the
    cast is a no-op and the gradients are the plain ones; in bf16 they carry bf16 rounding of the
    cotangent (the precision of PyTorch's autocast), with float32 accumulation.
    """
    return jnp.matmul(h, w, preferred_element_type=jnp.float32)


def _logits_matmul_fwd(h: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return logits_matmul(h, w), (h, w)


def _logits_matmul_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    h, w = res
    g = g.astype(h.dtype)
    dh = jnp.matmul(g, w.T, preferred_element_type=jnp.float32).astype(h.dtype)
    dw = jnp.matmul(h.T, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dh, dw


logits_matmul.defvjp(_logits_matmul_fwd, _logits_matmul_bwd)


def chunked_logprobs(
    h: jax.Array, unembed: jax.Array, targets: jax.Array, chunk: int, *, with_entropy: bool = True
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target token and the entropy of each next-token distribution.

    Args:
      h: [B, T, D] hidden states after the final norm (compute dtype).
      unembed: [D, V] the unembedding matrix (cast to h's dtype; logits accumulate in float32).
      targets: [B, T] int32, the token whose log-prob is wanted at each position.
      chunk: tokens per chunk of the T axis (T is padded up to a multiple internally).
      with_entropy: False skips the entropy (returns zeros), saving one pass over the chunk's logits.
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
    w = unembed.astype(h.dtype)
    # Chunk axis first, batch axis kept whole so its data-parallel sharding is untouched.
    h_chunks = h.reshape(b, n, c, d).transpose(1, 0, 2, 3)
    t_chunks = targets.reshape(b, n, c).transpose(1, 0, 2)

    @jax.checkpoint
    def one_chunk(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h_c, t_c = args
        # Rows flattened to one 2-D matmul (see models.layers.dense: XLA:CPU's backward then needs no
        # transposing copies).
        if jnp.dtype(h.dtype).itemsize < 4:  # bf16 / f16 compute: keep the backward products in that dtype
            logits = logits_matmul(h_c.reshape(-1, d), w)
        else:
            logits = jnp.matmul(h_c.reshape(-1, d), w, preferred_element_type=jnp.float32)
        logits = logits.reshape(*h_c.shape[:2], -1)
        logp = token_logprobs(logits, t_c)
        if with_entropy:
            ent = token_entropy(logits, jnp.ones(t_c.shape, bool))
        else:
            ent = jnp.zeros(t_c.shape, jnp.float32)
        return logp.astype(jnp.float32), ent.astype(jnp.float32)

    logp, ent = jax.lax.map(one_chunk, (h_chunks, t_chunks))
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
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """model_logprobs plus the value head on the same trunk: (logp, entropy, values), each [B, T]
    float32; values is None without a value head. Position p's value is that of the state scoring
    token p + 1 (aligned with logp)."""
    model = nnx.merge(graphdef, params, other)
    h = model.hidden(tokens, positions, segment_ids, attention=attention, remat=remat)
    logp, ent = chunked_logprobs(h, model.unembed_matrix(), targets, chunk, with_entropy=with_entropy)
    values = None if value_head is None else apply_value_head(value_head, h)
    return logp, ent, values


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
