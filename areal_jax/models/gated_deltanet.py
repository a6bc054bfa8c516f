"""Gated DeltaNet (arXiv 2412.06464): the linear-attention layers of Qwen3.5, between its layers of gated attention.

A layer keeps, per value head, a state S [key_dim, value_dim] that each token decays and corrects instead of a
cache that grows with the sequence:

    S <- exp(g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T q_t

with q_t, k_t L2-normalised (q_t also times key_dim ** -0.5), beta_t = sigmoid(b_t) and the decay
g_t = -exp(A_log) softplus(a_t + dt_bias). Queries, keys and values first pass a causal depthwise convolution
of `conv_kernel` taps and SiLU; the output is RMS-normalised per head, times SiLU(z_t) and projected back.

`delta_rule` computes the recurrence in chunks (the WY form: within a chunk a unit lower-triangular system, inverted
by matrix products alone (`unit_lower_inverse`), between chunks a scan carrying S), with packed rows' segments
kept apart: a segment starts from a zero state and its convolution sees only its own tokens. The convolved channels
are held key head by key head (`grouped_channels`), so that a tensor axis splits every part of a layer by heads. `delta_step` is one token's update, and `flat_delta_step` the same on the state as
the decode cache holds it (so XLA updates the buffer in place instead of copying it between layouts every step). In a KV-cache forward a layer's
cache entries hold its convolution window, k [B, conv_kernel - 1, channels, 1] (the last inputs, oldest first),
and its state, v [B, 1, value_heads * key_dim, value_dim] in float32 (`state_buffers`); a token at a negative
position (padding) leaves both unchanged, so a tail-padded prefill ends with each row's own state.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.layers import make_param, project

CHUNK = 64  # tokens per chunk of `delta_rule` (the within-chunk solve is CHUNK x CHUNK)


def channels(cfg: ModelConfig) -> int:
    """Width of the convolved projection: queries and keys (key_heads * key_dim each) and values."""
    m = cfg.linear
    return 2 * m.key_heads * m.key_dim + m.value_heads * m.value_dim


def grouped_channels(cfg: ModelConfig) -> np.ndarray:
    """Where our channels come from in HF's: in_proj_qkv and conv hold key head by key head its query, its key and
    its value heads' values side by side ([key_heads, 2 key_dim + value_heads / key_heads * value_dim]), so a tensor
    axis splits them by head; transformers keeps all queries, then all keys, then all values. Ours[j] = HF's[perm[j]]."""
    m = cfg.linear
    hk, qk, vals = m.key_heads, m.key_heads * m.key_dim, m.value_heads * m.value_dim
    return np.concatenate([np.arange(qk).reshape(hk, -1), qk + np.arange(qk).reshape(hk, -1),
                           2 * qk + np.arange(vals).reshape(hk, -1)], axis=1).reshape(-1)


def state_buffers(cfg: ModelConfig, rows: int) -> tuple[jax.Array, jax.Array]:
    """A linear layer's zero cache entries for `rows` rows: (convolution window [rows, conv_kernel - 1, channels, 1],
    state [rows, 1, value_heads * key_dim, value_dim]), both float32 (the state sums thousands of updates)."""
    m = cfg.linear
    return (jnp.zeros((rows, m.conv_kernel - 1, channels(cfg), 1), jnp.float32),
            jnp.zeros((rows, 1, m.value_heads * m.key_dim, m.value_dim), jnp.float32))


def state_bytes(cfg: ModelConfig) -> int:
    """Bytes of one row's `state_buffers` in one linear layer."""
    m = cfg.linear
    return 4 * ((m.conv_kernel - 1) * channels(cfg) + m.value_heads * m.key_dim * m.value_dim)


def weights(cfg: ModelConfig) -> tuple[int, int]:
    """(matrices, the rest) of one Gated DeltaNet layer: its projections; its convolution, decay parameters and norm."""
    m, d = cfg.linear, cfg.hidden_size
    hv = m.value_heads
    return d * (channels(cfg) + hv * m.value_dim + 2 * hv) + hv * m.value_dim * d, \
        m.conv_kernel * channels(cfg) + 2 * hv + m.value_dim


def adapter_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{LoRA short name: (inputs, outputs)} of a Gated DeltaNet layer's projections (OLMo Hybrid's q, k, v apart)."""
    m, d = cfg.linear, cfg.hidden_size
    values = m.value_heads * m.value_dim
    qkv = {"in_q": (d, m.key_heads * m.key_dim), "in_k": (d, m.key_heads * m.key_dim), "in_v": (d, values)} \
        if cfg.architecture == "olmo_hybrid" else {"in_qkv": (d, channels(cfg))}
    return {**qkv, "in_z": (d, values), "in_b": (d, m.value_heads), "in_a": (d, m.value_heads), "out": (values, d)}


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (float32)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def segment_conv(x: jax.Array, w: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Causal depthwise convolution of packed rows: x [B, T, C], w [K, C] (tap K-1 reads the token itself, tap j
    the one K-1-j before it), segment_ids [B, T]; a tap that reaches into another segment (or before the row) reads
    zero. Returns [B, T, C] in x's dtype, before the activation."""
    k_taps, t = w.shape[0], x.shape[1]
    out = x * w[-1]
    for back in range(1, k_taps):
        if back >= t:
            break
        shifted = jnp.pad(x, ((0, 0), (back, 0), (0, 0)))[:, :t]
        same = jnp.pad(segment_ids, ((0, 0), (back, 0)), constant_values=-1)[:, :t] == segment_ids
        out = out + jnp.where(same[..., None], shifted, 0) * w[k_taps - 1 - back]
    return out


def window_conv(x: jax.Array, w: jax.Array, window: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise convolution continuing from a window of earlier inputs: x [B, T, C], w [K, C], window
    [B, K-1, C] (oldest first), valid [B, T] (a row's valid tokens come first). Returns (output [B, T, C] before the
    activation, the new window: the last K-1 inputs up to each row's last valid token)."""
    k_taps, t = w.shape[0], x.shape[1]
    full = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    out = sum(full[:, j:j + t] * w[j] for j in range(k_taps))
    n = jnp.sum(valid.astype(jnp.int32), axis=1)  # [B]
    index = n[:, None] + jnp.arange(k_taps - 1)[None, :]  # the window after the row's last valid token
    return out, jnp.take_along_axis(full, index[..., None], axis=1)


def unit_lower_inverse(t: jax.Array) -> jax.Array:
    """The inverse of unit lower-triangular matrices t [..., C, C], by block doubling: the inverses of the diagonal
    blocks of size s give those of size 2s as [[L1^-1, 0], [-L2^-1 M L1^-1, L2^-1]] (M the block below L1).

    Batched matrix products only, for every backend and its gradient alike. (Not `solve_triangular`: on the CPU two
    of its batched LAPACK calls running at once can each wait on the other for the same worker threads, and the
    trainer's backward stops there with the CPU idle.)"""
    c = t.shape[-1]
    size = 1 << max(c - 1, 0).bit_length()  # the next power of two; padded with the identity
    if size != c:
        pad = [(0, 0)] * (t.ndim - 2) + [(0, size - c)] * 2
        t = jnp.pad(t, pad) + np.diag(np.arange(size) >= c).astype(t.dtype)
    batch = t.shape[:-2]
    inv = jnp.ones(batch + (size, 1, 1), t.dtype)  # [..., blocks, s, s]: the diagonal blocks' inverses
    s = 1
    while s < size:
        m = size // (2 * s)
        blocks = t.reshape(batch + (m, 2 * s, m, 2 * s))
        below = jnp.diagonal(blocks, axis1=-4, axis2=-2)  # [..., 2s, 2s, m]: the diagonal 2s-blocks
        below = jnp.moveaxis(below, -1, -3)[..., s:, :s]  # [..., m, s, s]: M of each pair
        pairs = inv.reshape(batch + (m, 2, s, s))
        first, second = pairs[..., 0, :, :], pairs[..., 1, :, :]
        corner = -second @ below @ first
        zeros = jnp.zeros_like(corner)
        inv = jnp.concatenate([jnp.concatenate([first, zeros], -1), jnp.concatenate([corner, second], -1)], -2)
        s *= 2
    return inv.reshape(batch + (size, size))[..., :c, :c]


def delta_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
               state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv] (all float32) ->
    (o [B, H, Dv], the new state). The recurrence as written: the reference of the tests and of
    benchmarks/delta_rule.py; the sampler's decode runs `flat_delta_step` (the same step in its buffer's layout)."""
    state = state * jnp.exp(g)[..., None, None]
    delta = (v - jnp.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", state, q), state


def flat_delta_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                    state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`delta_step` on the state as its cache buffer holds it, [B, 1, H * Dk, Dv] float32: the new state is written by
    elementwise operations in that shape (each head's decay, key and delta spread over its Dk rows), so it keeps the
    buffer's layout; the two products only read it, per head. q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H] ->
    (o [B, H, Dv], the new state). On the CPU, 4 layers (3 of them Gated DeltaNet at 32 value heads of 128) x 32
    slots: 147 ms a decode step against 199 for `delta_step` on the reshaped buffer (which XLA copied between two
    layouts each step), and 415 with reductions in place of the products."""
    b, h, dk = k.shape
    rows = lambda x: x.reshape(b, 1, h * dk, -1)  # noqa: E731 ([B, H, Dk, ...] -> the buffer's rows)
    decayed = state * rows(jnp.broadcast_to(jnp.exp(g)[..., None, None], (b, h, dk, 1)))
    ks = rows(k[..., None])
    delta = (v - jnp.einsum("bhkv,bhk->bhv", decayed.reshape(b, h, dk, -1), k)) * beta[..., None]
    state = decayed + ks * rows(jnp.broadcast_to(delta[:, :, None, :], (b, h, dk, delta.shape[-1])))
    return jnp.einsum("bhkv,bhk->bhv", state.reshape(b, h, dk, -1), q), state


def chunking(t: int, chunk: int) -> tuple[int, int, Callable[..., jax.Array]]:
    """(chunk size, chunks, chunked) for rows of t tokens in chunks of at most `chunk` (t rounded up to 8 when shorter):
    chunked(x [B, T, ...], mode) pads the rows (zeros, or "edge": the last value) and returns [N, B, H?, C, ...]
    (the chunk first; a head axis, where x has one past T, before the chunk's tokens)."""
    size = min(chunk, max(8, -(-t // 8) * 8))
    pad = -t % size
    n = (t + pad) // size

    def chunked(x: jax.Array, mode: str = "constant") -> jax.Array:
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), mode=mode)
        x = x.reshape(x.shape[0], n, size, *x.shape[2:])
        return jnp.moveaxis(x, (1, 3), (0, 2)) if x.ndim > 3 else jnp.moveaxis(x, 1, 0)

    return size, n, chunked


def delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
               segment_ids: jax.Array | None = None, state: jax.Array | None = None,
               chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over whole rows, chunk by chunk.

    q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H] (float32; a token with g = beta = 0 leaves the state as
    it is). segment_ids [B, T]: packed rows, each segment from a zero state (contiguous segments; None: one per
    row). state [B, H, Dk, Dv]: the state before the first token (None: zeros). Returns (o [B, T, H, Dv], the state
    after the last token) in float32."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    c, n, chunked = chunking(t, chunk)
    seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

    qs, ks, vs = chunked(q), chunked(k), chunked(v)  # [N, B, H, C, D]
    gs, bs = chunked(g), chunked(beta)  # [N, B, H, C]
    segs = chunked(seg, "edge")  # [N, B, C]: padding continues the last segment
    cum = jnp.cumsum(gs, axis=-1)
    lower = np.tril(np.ones((c, c), bool))
    same = (segs[..., :, None] == segs[..., None, :]) & lower  # [N, B, C, C]
    same = same[:, :, None]
    decay = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # i >= j, one segment
    kb = ks * bs[..., None]
    strict = decay * (1 - np.eye(c, dtype=np.float32))
    system = jnp.einsum("nbhid,nbhjd->nbhij", kb, ks) * strict + np.eye(c, dtype=np.float32)
    rhs = jnp.concatenate([vs * bs[..., None], kb * jnp.exp(cum)[..., None]], axis=-1)
    solved = unit_lower_inverse(system) @ rhs
    u, w = solved[..., :dv], solved[..., dv:]  # the corrections before the carried state; its keys
    scores = jnp.einsum("nbhid,nbhjd->nbhij", qs, ks) * decay
    q_decayed = qs * jnp.exp(cum)[..., None]
    last = segs[..., -1:]  # [N, B, 1]
    k_to_end = ks * jnp.where((segs == last)[:, :, None], jnp.exp(cum[..., -1:] - cum), 0)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [N, B, H]
    firsts = jnp.concatenate([seg[:, :1][None], segs[:-1, :, -1:]], axis=0)  # the segment each chunk continues

    def step(s: jax.Array, xs: tuple) -> tuple[jax.Array, jax.Array]:
        u_n, w_n, qd_n, sc_n, kend_n, cd_n, seg_n, before, last_n = xs
        cont = (seg_n == before)[:, None, :, None].astype(jnp.float32)  # [B, 1, C, 1]: the token reads the state
        v_new = u_n - cont * jnp.einsum("bhcd,bhde->bhce", w_n, s)
        o = cont * jnp.einsum("bhcd,bhde->bhce", qd_n, s) + jnp.einsum("bhij,bhje->bhie", sc_n, v_new)
        keep = (last_n == before)[:, :, None, None].astype(jnp.float32)  # [B, 1, 1, 1]: one segment throughout
        s = s * (cd_n[..., None, None] * keep) + jnp.einsum("bhcd,bhce->bhde", kend_n, v_new)
        return s, o

    s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    s, out = jax.lax.scan(step, s0, (u, w, q_decayed, scores, k_to_end, chunk_decay, segs, firsts, last))
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(b, n * c, h, dv)[:, :t]  # [N, B, H, C, Dv] -> [B, T, H, Dv]
    return out, s


@dataclasses.dataclass
class Segments:
    """The cache-free forward's context of a linear layer: packed rows' segment ids [B, T] (0: padding)."""

    segment_ids: jax.Array


@dataclasses.dataclass
class StateCache:
    """A KV-cache forward's context of a linear layer: its window and state (`state_buffers`' layout), which tokens
    advance them (valid [B, T]: position >= 0) and where the new ones go (`store(window, state)`)."""

    window: jax.Array
    state: jax.Array
    valid: jax.Array
    store: Callable[[jax.Array, jax.Array], None]


class GatedDeltaNet(nnx.Module):
    """A Gated DeltaNet layer as Qwen3.5 lays it out: in_proj_qkv [D, channels], in_proj_z [D, Hv * Dv],
    in_proj_b and in_proj_a [D, Hv], conv [K, channels], dt_bias and A_log [Hv], the gated norm's scale [Dv]
    (plain, not 1 + w) and out_proj [Hv * Dv, D]. On a tensor axis those of Hv split by value heads ("heads"),
    in_proj_qkv and conv by key heads ("kv_heads": their channels are grouped so, `grouped_channels`). OLMo Hybrid's
    projects q, k and v apart (in_proj_q, in_proj_k [D, Hk * Dk], in_proj_v [D, Hv * Dv], split by key heads too)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m, d, pdt = cfg.linear, cfg.hidden_size, cfg.param_dtype
        hv, c = m.value_heads, channels(cfg)
        self.dtype, self.eps, self.shape = cfg.dtype, cfg.rms_norm_eps, m
        if cfg.architecture == "olmo_hybrid":  # q, k, v projected apart; the gated norm's epsilon 1e-5 (FLA's)
            self.eps, self.in_proj_qkv = 1e-5, None
            widths = (m.key_heads * m.key_dim, m.key_heads * m.key_dim, hv * m.value_dim)
            self.in_proj_q, self.in_proj_k, self.in_proj_v = (make_param(rngs, (d, w), ("embed", "kv_heads"), pdt)
                                                              for w in widths)
        else:
            self.in_proj_qkv = make_param(rngs, (d, c), ("embed", "kv_heads"), pdt)
        self.conv = make_param(rngs, (m.conv_kernel, c), (None, "kv_heads"), pdt, std=0.5)
        self.in_proj_z = make_param(rngs, (d, hv * m.value_dim), ("embed", "heads"), pdt)
        self.in_proj_b = make_param(rngs, (d, hv), ("embed", "heads"), pdt)
        self.in_proj_a = make_param(rngs, (d, hv), ("embed", "heads"), pdt)
        self.dt_bias = make_param(None, (hv,), ("heads",), pdt, init="ones")
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, hv)).astype(pdt), out_sharding=("heads",),
                               eager_sharding=False)
        self.norm_scale = make_param(None, (m.value_dim,), ("norm",), pdt, init="ones")
        self.out_proj = make_param(rngs, (hv * m.value_dim, d), ("heads", "embed"), pdt)

    def __call__(self, x: jax.Array, context: Segments | StateCache) -> jax.Array:
        """x [B, T, D] (the layer's normed input) -> [B, T, D] in the compute dtype."""
        m, dt = self.shape, self.dtype
        b, t, _ = x.shape
        hk, hv, dk, dv = m.key_heads, m.value_heads, m.key_dim, m.value_dim
        if self.in_proj_qkv is None:  # OLMo Hybrid: its projections side by side key head by key head
            mixed = jnp.concatenate([project(x, w, dt).reshape(b, t, hk, -1) for w in (
                self.in_proj_q, self.in_proj_k, self.in_proj_v)], axis=-1).reshape(b, t, -1)
        else:
            mixed = project(x, self.in_proj_qkv, dt)  # (each a parameter, or LoRA's base plus adapters)
        z = project(x, self.in_proj_z, dt).reshape(b, t, hv, dv)
        gate_b = project(x, self.in_proj_b, dt).astype(jnp.float32)
        gate_a = project(x, self.in_proj_a, dt).astype(jnp.float32)
        w = self.conv[...].astype(dt)
        if isinstance(context, Segments):
            mixed = segment_conv(mixed, w, context.segment_ids)
            valid = None
        else:
            valid = context.valid
            mixed, window = window_conv(mixed, w, context.window[..., 0], valid)
        mixed = jax.nn.silu(mixed)
        mixed = mixed.reshape(b, t, hk, -1)  # key head by key head (`grouped_channels`)
        q = mixed[..., :dk].astype(jnp.float32)
        k = mixed[..., dk: 2 * dk].astype(jnp.float32)
        v = mixed[..., 2 * dk:].reshape(b, t, hv, dv).astype(jnp.float32)
        if hv != hk:  # query / key head i serves value heads i * r .. i * r + r - 1
            q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
        q = l2_normalize(q) * np.float32(1.0 / math.sqrt(dk))
        k = l2_normalize(k)
        beta = jax.nn.sigmoid(gate_b) if m.beta_scale == 1.0 else jax.nn.sigmoid(gate_b) * np.float32(m.beta_scale)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(gate_a + self.dt_bias[...].astype(
            jnp.float32))
        if valid is None:
            o, _ = delta_rule(q, k, v, g, beta, context.segment_ids)
        else:
            g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
            if t == 1:
                o, state = flat_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], context.state)
                o = o[:, None]
            else:
                o, state = delta_rule(q, k, v, g, beta, state=context.state.reshape(b, hv, dk, dv))
                state = state.reshape(context.state.shape)
            context.store(window[..., None].astype(context.window.dtype), state.astype(context.state.dtype))
        o = o.astype(dt).astype(jnp.float32)  # the rule's output in the compute dtype, as the norm receives it
        normed = (o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.eps)).astype(dt)
        y = (normed * self.norm_scale[...].astype(dt)).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        return project(y.astype(dt).reshape(b, t, hv * dv), self.out_proj, dt)


Mixer = GatedDeltaNet
