"""The Mamba mixer (selective state spaces, arXiv 2312.00752) of Jamba's, Mamba's and Falcon-Mamba's layers: a state
per channel, decaying per channel and state.

A layer projects each token to channels x and a gate z (`inner` each); x passes a causal depthwise convolution (with
a bias) and SiLU, then gives the token's time step (a rank-`dt_rank` input), B and C (`state` each); Jamba and
Falcon-Mamba RMS-normalise those three (`Mamba1.norms`). Per channel i it keeps h_i [state]:

    dt = softplus(dt_in @ dt_proj + dt_bias);   h_i <- exp(dt_i A_i) * h_i + dt_i x_i B;   y_i = h_i . C + D_i x_i

with A = -exp(A_log) [inner, state]; the output y silu(z) is projected back.

`selective_scan` runs it over whole rows chunk by chunk (within a chunk an associative scan of the pairs (decay,
input), rematerialised in the backward pass, so a row keeps one state per chunk; between chunks a scan carrying h),
packed rows' segments each from a zero state. In a KV-cache forward a layer's cache entries are its convolution
window, k [B, conv_kernel - 1, inner, 1], and its state, v [B, 1, inner, state] float32 (`state_buffers`); a token at a
negative position (padding) leaves both unchanged (its dt is zero: no decay, no write). On a tensor axis every part
splits by channels (the "heads" logical axis): the projections into x and z by columns, x_proj by rows (its dt, B
and C summed over the shards), dt_proj by columns, out_proj by rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.gated_deltanet import Segments, StateCache, chunking, segment_conv, window_conv
from areal_jax.models.layers import make_param, project

CHUNK = 64


def state_buffers(cfg, rows: int) -> tuple[jax.Array, jax.Array]:
    """A Mamba layer's zero cache entries for `rows` rows: (window [rows, conv_kernel - 1, inner, 1], state
    [rows, 1, inner, state]), both float32."""
    m = cfg.mamba1
    return (jnp.zeros((rows, m.conv_kernel - 1, m.inner, 1), jnp.float32),
            jnp.zeros((rows, 1, m.inner, m.state), jnp.float32))


def state_bytes(cfg) -> int:
    """Bytes of one row's `state_buffers` in one Mamba layer."""
    m = cfg.mamba1
    return 4 * ((m.conv_kernel - 1) * m.inner + m.inner * m.state)


def weights(cfg) -> tuple[int, int]:
    """(matrices, the rest) of one Mamba layer: in_proj (x, z), x_proj (dt, B, C), dt_proj and out_proj; the taps and
    their bias, dt_bias, A_log, D and the norms of dt, B and C."""
    m, d = cfg.mamba1, cfg.hidden_size
    matrices = 2 * d * m.inner + m.inner * (m.dt_rank + 2 * m.state) + m.dt_rank * m.inner + m.inner * d
    scales = m.dt_rank + 2 * m.state if m.norms == "scaled" else 0
    return matrices, (m.conv_kernel + 3) * m.inner + m.inner * m.state + scales


def adapter_dims(cfg) -> dict[str, tuple[int, int]]:
    """{LoRA short name: (inputs, outputs)} of a Mamba layer's large projections (in_proj's parts x and z; out)."""
    m, d = cfg.mamba1, cfg.hidden_size
    return {"in_x": (d, m.inner), "in_z": (d, m.inner), "out": (m.inner, d)}


def selective_scan(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
                   segment_ids: jax.Array | None = None, state: jax.Array | None = None,
                   chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The scan over whole rows, chunk by chunk. x, dt [B, T, I] (dt after softplus; 0 leaves the state as it is);
    a [I, N] (negative); b, c [B, T, N]; segment_ids [B, T] (contiguous segments, each from a zero state; None: one
    per row); state [B, I, N] before the first token (None: zeros). Returns (y [B, T, I] without D's skip, the state
    after the last token), float32."""
    bsz, t, _ = x.shape
    size, n, _ = chunking(t, chunk)

    def chunked(v: jax.Array) -> jax.Array:  # [B, T, ...] -> [Nc, B, C, ...], zeros after the last token
        v = jnp.pad(v, ((0, 0), (0, n * size - t)) + ((0, 0),) * (v.ndim - 2))
        return jnp.moveaxis(v.reshape(bsz, n, size, *v.shape[2:]), 1, 0)

    seg = jnp.ones((bsz, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    starts = (seg != jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)).astype(jnp.float32)  # a new segment's first
    xs, dts, bs, cs = (chunked(v.astype(jnp.float32)) for v in (x, dt, b, c))  # padding: dt 0
    keeps = 1.0 - chunked(starts)  # [Nc, B, C]: padding keeps the state

    def combine(first: tuple, second: tuple) -> tuple:
        return first[0] * second[0], second[0] * first[1] + second[1]

    @jax.checkpoint  # the backward pass recomputes a chunk's [B, C, I, N] pairs from its inputs and starting state
    def step(h: jax.Array, inputs: tuple) -> tuple[jax.Array, jax.Array]:
        x_c, dt_c, b_c, c_c, keep = inputs
        decay = jnp.exp(dt_c[..., None] * a) * keep[..., None, None]  # [B, C, I, N]
        write = (dt_c * x_c)[..., None] * b_c[:, :, None, :]
        decays, writes = jax.lax.associative_scan(combine, (decay, write), axis=1)
        hs = decays * h[:, None] + writes  # each token's state
        return hs[:, -1], jnp.einsum("bcin,bcn->bci", hs, c_c)

    h0 = jnp.zeros((bsz, *a.shape), jnp.float32) if state is None else state.astype(jnp.float32)
    h, ys = jax.lax.scan(step, h0, (xs, dts, bs, cs, keeps))
    return jnp.moveaxis(ys, 0, 1).reshape(bsz, -1, x.shape[-1])[:, :t], h


def scan_step(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
              state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row: x, dt [B, I], a [I, N], b, c [B, N], state [B, I, N] (float32) -> (y [B, I] without D's
    skip, the new state). The recurrence as written."""
    state = state * jnp.exp(dt[..., None] * a) + (dt * x)[..., None] * b[:, None, :]
    return jnp.einsum("bin,bn->bi", state, c), state


def _rms(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
    """Llama's RMSNorm of x [..., N] (in float32) by scale [N] (None: none, Falcon-Mamba's), in x's dtype."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return normed if scale is None else (scale.astype(jnp.float32) * normed).astype(x.dtype)


class Mamba1Mixer(nnx.Module):
    """Jamba's Mamba mixer: in_proj_x and in_proj_z [D, I] (one in_proj on disk), conv [K, I] and conv_bias [I],
    x_proj_dt [I, R], x_proj_b and x_proj_c [I, N] (one x_proj on disk), the norms' scales dt_norm [R], b_norm and
    c_norm [N] (Jamba's; Falcon-Mamba's norms have none, Mamba's no norms), dt_proj [R, I] and dt_bias [I], A_log [I, N], D [I], out_proj [I, D]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        m, d, pdt = cfg.mamba1, cfg.hidden_size, cfg.param_dtype
        self.dtype, self.shape = cfg.dtype, m
        self.eps = cfg.rms_norm_eps if m.norm_eps is None else m.norm_eps
        i, n, r = m.inner, m.state, m.dt_rank
        self.in_proj_x = make_param(rngs, (d, i), ("embed", "heads"), pdt)
        self.in_proj_z = make_param(rngs, (d, i), ("embed", "heads"), pdt)
        self.conv = make_param(rngs, (m.conv_kernel, i), (None, "heads"), pdt, std=0.5)
        self.conv_bias = make_param(rngs, (i,), ("heads",), pdt, init="zeros")
        self.x_proj_dt = make_param(rngs, (i, r), ("heads", None), pdt)
        self.x_proj_b = make_param(rngs, (i, n), ("heads", None), pdt)
        self.x_proj_c = make_param(rngs, (i, n), ("heads", None), pdt)
        self.dt_norm, self.b_norm, self.c_norm = ((make_param(None, (k,), (None,), pdt, init="ones") for k in (r, n, n))
                                                  if m.norms == "scaled" else (None, None, None))
        self.dt_proj = make_param(rngs, (r, i), (None, "heads"), pdt)
        self.dt_bias = make_param(None, (i,), ("heads",), pdt, init="zeros")
        self.A_log = nnx.Param(jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32), (i, n))).astype(pdt),
                               out_sharding=("heads", None), eager_sharding=False)
        self.D = make_param(None, (i,), ("heads",), pdt, init="ones")
        self.out_proj = make_param(rngs, (i, d), ("heads", "embed"), pdt)

    def __call__(self, h: jax.Array, context: Segments | StateCache) -> jax.Array:
        """h [B, T, D] (the layer's normed input) -> [B, T, D] in the compute dtype."""
        dt_, t = self.dtype, h.shape[1]
        x = project(h, self.in_proj_x, dt_)
        z = project(h, self.in_proj_z, dt_)
        w = self.conv[...].astype(dt_)
        if isinstance(context, Segments):
            x, valid = segment_conv(x, w, context.segment_ids), None
        else:
            valid = context.valid
            x, window = window_conv(x, w, context.window[..., 0], valid)
        x = jax.nn.silu(x + self.conv_bias[...].astype(dt_))
        dt_in, b, c = (project(x, p, dt_) for p in (self.x_proj_dt, self.x_proj_b, self.x_proj_c))
        if self.shape.norms is not None:  # RMSNorms of the time step's input, B and C (Jamba's, Falcon-Mamba's)
            dt_in, b, c = (_rms(v, None if s is None else s[...], self.eps)
                           for v, s in ((dt_in, self.dt_norm), (b, self.b_norm), (c, self.c_norm)))
        dt = project(dt_in, self.dt_proj, dt_).astype(jnp.float32)
        dt = jax.nn.softplus(dt + self.dt_bias[...].astype(jnp.float32))
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        xf, b, c = x.astype(jnp.float32), b.astype(jnp.float32), c.astype(jnp.float32)
        if valid is None:
            y, _ = selective_scan(xf, dt, a, b, c, context.segment_ids)
        else:
            dt = jnp.where(valid[..., None], dt, 0.0)
            state = context.state[:, 0]
            if t == 1:
                y, state = scan_step(xf[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], state)
                y = y[:, None]
            else:
                y, state = selective_scan(xf, dt, a, b, c, state=state)
            context.store(window[..., None].astype(context.window.dtype), state[:, None].astype(context.state.dtype))
        y = (y + xf * self.D[...].astype(jnp.float32)) * jax.nn.silu(z.astype(jnp.float32))
        return project(y.astype(dt_), self.out_proj, dt_)


Mixer = Mamba1Mixer
