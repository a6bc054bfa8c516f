"""The Mamba-2 mixer (arXiv 2405.21060) of Granite 4.0-H's layers: a state space layer with one scalar decay per head.

A layer projects each token to a gate z, the convolved channels x (heads of `head_dim`), B and C (`groups` groups of
`state` each, a group serving heads / groups heads) and a time step dt per head; per head it keeps S [head_dim, state]:

    dt = softplus(dt + dt_bias);   S <- exp(dt A) S + dt x B^T;   y = S C + D x

with A = -exp(A_log); x, B and C first pass a causal depthwise convolution (with a bias) and SiLU. The output is
RMS-normalised in `groups` groups after the gate (y silu(z)), scaled, and projected back (`Mamba2.norm`: Falcon-H1's
may have no norm, or one before the gate). Falcon-H1 also scales the mixer's input (ssm_in) and in_proj's five parts
(z, x, B, C, dt: `HybridScales.ssm_parts`) before anything else.

`ssd` computes it over whole rows in chunks (within a chunk the scores (C_i . B_j) times the decay between j and i;
between chunks a scan carrying S), packed rows' segments each from a zero state; `ssd_step` is one token's update.
In a KV-cache forward a layer's cache entries are its convolution window, k [B, conv_kernel - 1, channels, 1], and its
state, v [B, 1, heads * head_dim, state] float32 (`state_buffers`); a token at a negative position (padding) leaves
both unchanged (its dt is zero: no decay, no write).

On a tensor axis the mixer splits by heads: z, dt and their parameters, the norm's scale and out_proj by heads; x, B
and C (their projection, convolution and window) by whole groups, held group by group (`grouped_channels`), where
there are several groups; a single group's B and C are held whole on every device (x then too: its projection is one
matrix with B's and C's). The state splits by heads as the cache's third axis does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.config_checks import Mamba2
from areal_jax.models.gated_deltanet import Segments, StateCache, chunking, segment_conv, window_conv
from areal_jax.models.hf_family import reader
from areal_jax.models.layers import make_param, project

CHUNK = 64


_MAMBA_DEFAULTS = dict(mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2,
                       mamba_conv_bias=True, mamba_proj_bias=False)


def shapes_from_hf(d: dict, hidden: int) -> Mamba2:
    """The Mamba-2 mixers' shapes of a config.json's mamba_* keys (Granite 4.0-H's, Bamba's; transformers' defaults
    where a key is absent); a mixer this module does not compute (no convolution bias, projection biases, a clamped
    time step) is refused."""

    get = reader(d, _MAMBA_DEFAULTS, none_is_default=True)

    if not get("mamba_conv_bias") or get("mamba_proj_bias"):
        raise ValueError("The Mamba-2 mixers here have a convolution bias and no projection biases "
                         "(mamba_conv_bias=true, mamba_proj_bias=false), as the released checkpoints have.")
    limit = [float(x["__float__"]) if isinstance(x, dict) else float(x) for x in d.get("time_step_limit") or ()]
    if limit and limit != [0.0, float("inf")]:  # (transformers writes infinity as {"__float__": "Infinity"})
        raise ValueError(f"time_step_limit={limit}: a clamped time step is not supported here (the released "
                         "checkpoints take (0, inf)).")
    heads, inner = int(get("mamba_n_heads")), int(get("mamba_expand")) * hidden
    head_dim = inner // heads if d.get("mamba_d_head") in (None, "auto") else int(d["mamba_d_head"])
    if head_dim * heads != inner:
        raise ValueError(f"mamba_n_heads={heads} x mamba_d_head={head_dim} must be mamba_expand x hidden_size={inner}.")
    return Mamba2(heads, head_dim, int(get("mamba_d_state")), int(get("mamba_n_groups")), int(get("mamba_d_conv")))


def hf_keys(cfg) -> dict:
    """The config.json's mamba_* keys of `cfg.mamba`."""
    m = cfg.mamba
    return dict(mamba_n_heads=m.heads, mamba_d_head=m.head_dim, mamba_d_state=m.state, mamba_n_groups=m.groups,
                mamba_d_conv=m.conv_kernel, mamba_expand=m.heads * m.head_dim // cfg.hidden_size, mamba_conv_bias=True,
                mamba_proj_bias=False)


def channels(cfg) -> int:
    """The convolved channels: x (heads * head_dim), then B and C (groups * state each)."""
    m = cfg.mamba
    return m.heads * m.head_dim + 2 * m.groups * m.state


def grouped_channels(cfg) -> np.ndarray:
    """Where our convolved channels come from in HF's: in_proj_xbc, the convolution and its bias hold group by group
    its heads' x, its B and its C side by side ([groups, heads / groups * head_dim + 2 state]), so a tensor axis that
    divides the groups splits them by whole groups (and so by heads); transformers keeps all of x, then all of B, then
    all of C. Ours[j] = HF's[perm[j]] (with one group the two orders are the same)."""
    return _grouped(cfg.mamba)


def _grouped(m: Mamba2) -> np.ndarray:
    x, n = m.heads // m.groups * m.head_dim, m.state
    inner, g = m.heads * m.head_dim, np.arange(m.groups)[:, None]
    return np.concatenate([g * x + np.arange(x), inner + g * n + np.arange(n),
                           inner + m.groups * n + g * n + np.arange(n)], axis=1).reshape(-1)


def state_buffers(cfg, rows: int) -> tuple[jax.Array, jax.Array]:
    """A Mamba-2 layer's zero cache entries for `rows` rows: (window [rows, conv_kernel - 1, channels, 1], state
    [rows, 1, heads * head_dim, state]), both float32."""
    m = cfg.mamba
    return (jnp.zeros((rows, m.conv_kernel - 1, channels(cfg), 1), jnp.float32),
            jnp.zeros((rows, 1, m.heads * m.head_dim, m.state), jnp.float32))


def state_bytes(cfg) -> int:
    """Bytes of one row's `state_buffers` in one Mamba-2 layer."""
    m = cfg.mamba
    return 4 * ((m.conv_kernel - 1) * channels(cfg) + m.heads * m.head_dim * m.state)


def weights(cfg) -> tuple[int, int]:
    """(matrices, the rest) of one Mamba-2 layer: in_proj (z, x B C, dt) and out_proj; the taps and their bias,
    dt_bias, A_log, D and the norm."""
    m, d = cfg.mamba, cfg.hidden_size
    inner, ch = m.heads * m.head_dim, channels(cfg)
    return d * (inner + ch + m.heads) + inner * d, (m.conv_kernel + 1) * ch + 3 * m.heads + (inner if m.norm else 0)


def adapter_dims(cfg) -> dict[str, tuple[int, int]]:
    """{LoRA short name: (inputs, outputs)} of a Mamba-2 layer's projections (in_proj's parts z, x B C, dt; out)."""
    m, d = cfg.mamba, cfg.hidden_size
    inner = m.heads * m.head_dim
    return {"in_z": (d, inner), "in_xbc": (d, channels(cfg)), "in_dt": (d, m.heads), "out": (inner, d)}


def ssd(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array, segment_ids: jax.Array | None = None,
        state: jax.Array | None = None, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The scan over whole rows, chunk by chunk. x [B, T, H, P]; dt [B, T, H] (after softplus; 0 leaves the state as
    it is); a [H] (negative); b, c [B, T, H, N] (each head's group's); segment_ids [B, T] (contiguous segments, each
    from a zero state; None: one per row); state [B, H, P, N] before the first token (None: zeros). Returns (y
    [B, T, H, P] without D's skip, the state after the last token), float32."""
    bsz, t, h, p = x.shape
    n = b.shape[-1]
    size, chunks, chunked = chunking(t, chunk)
    seg = jnp.ones((bsz, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

    v = x * dt[..., None]
    vs, bs, cs = chunked(v), chunked(b), chunked(c)  # [N, B, H, C, P | N]
    cum = jnp.cumsum(chunked(dt * a), axis=-1)  # [N, B, H, C]: log decay from the chunk's start
    segs = chunked(seg, "edge")  # [N, B, C]: padding continues the last segment
    lower = np.tril(np.ones((size, size), bool))
    same = ((segs[..., :, None] == segs[..., None, :]) & lower)[:, :, None]  # [N, B, 1, C, C]
    decay = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    scores = jnp.einsum("kbhis,kbhjs->kbhij", cs, bs) * decay  # (k: the chunk, s: the state)
    c_decayed = cs * jnp.exp(cum)[..., None]
    last = segs[..., -1:]  # [N, B, 1]
    b_to_end = bs * jnp.where((segs == last)[:, :, None], jnp.exp(cum[..., -1:] - cum), 0)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [N, B, H]
    firsts = jnp.concatenate([seg[:, :1][None], segs[:-1, :, -1:]], axis=0)  # the segment each chunk continues

    def step(s: jax.Array, xs: tuple) -> tuple[jax.Array, jax.Array]:
        v_n, cd_n, sc_n, bend_n, dec_n, seg_n, before, last_n = xs
        cont = (seg_n == before)[:, None, :, None].astype(jnp.float32)  # [B, 1, C, 1]: the token reads the state
        y = cont * jnp.einsum("bhcn,bhpn->bhcp", cd_n, s) + jnp.einsum("bhij,bhjp->bhip", sc_n, v_n)
        keep = (last_n == before)[:, :, None, None].astype(jnp.float32)  # [B, 1, 1, 1]: one segment throughout
        s = s * (dec_n[..., None, None] * keep) + jnp.einsum("bhcp,bhcn->bhpn", v_n, bend_n)
        return s, y

    s0 = jnp.zeros((bsz, h, p, n), jnp.float32) if state is None else state.astype(jnp.float32)
    s, out = jax.lax.scan(step, s0, (vs, c_decayed, scores, b_to_end, chunk_decay, segs, firsts, last))
    return jnp.moveaxis(out, (0, 2), (1, 3)).reshape(bsz, chunks * size, h, p)[:, :t], s


def ssd_step(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
             state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row: x [B, H, P], dt [B, H], a [H], b, c [B, H, N], state [B, H, P, N] (float32) -> (y [B, H, P]
    without D's skip, the new state). The recurrence as written."""
    state = state * jnp.exp(dt * a)[..., None, None] + (x * dt[..., None])[..., None] * b[:, :, None, :]
    return jnp.einsum("bhpn,bhn->bhp", state, c), state


class Mamba2Mixer(nnx.Module):
    """Granite 4.0-H's Mamba-2 mixer: in_proj_z [D, H * P], in_proj_xbc [D, channels], in_proj_dt [D, H] (one in_proj
    on disk), conv [K, channels] and conv_bias [channels], dt_bias, A_log and D [H], the gated norm's scale [H * P]
    and out_proj [H * P, D]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        m, d, pdt = cfg.mamba, cfg.hidden_size, cfg.param_dtype
        inner, ch = m.heads * m.head_dim, channels(cfg)
        self.dtype, self.eps, self.shape = cfg.dtype, cfg.rms_norm_eps, m
        groups = "kv_heads" if m.groups > 1 else None  # x B C split by whole groups; one group: held whole
        self.in_proj_z = make_param(rngs, (d, inner), ("embed", "heads"), pdt)
        self.in_proj_xbc = make_param(rngs, (d, ch), ("embed", groups), pdt)
        self.in_proj_dt = make_param(rngs, (d, m.heads), ("embed", "heads"), pdt)
        self.conv = make_param(rngs, (m.conv_kernel, ch), (None, groups), pdt, std=0.5)
        self.conv_bias = make_param(rngs, (ch,), (groups,), pdt, init="zeros")
        self.dt_bias = make_param(None, (m.heads,), ("heads",), pdt, init="ones")
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, m.heads + 1, dtype=jnp.float32)).astype(pdt),
                               out_sharding=("heads",), eager_sharding=False)
        self.D = make_param(None, (m.heads,), ("heads",), pdt, init="ones")
        self.norm_scale = None if m.norm is None else make_param(None, (inner,), ("heads",), pdt, init="ones")
        self.out_proj = make_param(rngs, (inner, d), ("heads", "embed"), pdt)
        s = cfg.hybrid_scales  # Falcon-H1's: the input's multiplier and in_proj's parts' (z, x, B, C, dt)
        self.scales = None if s is None else (s.ssm_in, s.ssm_parts)

    def __call__(self, x: jax.Array, context: Segments | StateCache) -> jax.Array:
        """x [B, T, D] (the layer's normed input) -> [B, T, D] in the compute dtype."""
        m, dt_ = self.shape, self.dtype
        bsz, t, _ = x.shape
        h, p, g, n = m.heads, m.head_dim, m.groups, m.state
        if self.scales is not None:  # (x times ssm_in; in_proj's parts times theirs: Falcon-H1's)
            x = x * jnp.asarray(self.scales[0], x.dtype)
        z = project(x, self.in_proj_z, dt_)
        xbc = project(x, self.in_proj_xbc, dt_)
        dt = project(x, self.in_proj_dt, dt_).astype(jnp.float32)
        if self.scales is not None:
            parts = np.asarray(self.scales[1], np.float32)
            per_channel = np.repeat(parts[1:4], [h * p, g * n, g * n])[_grouped(m)]  # in our channel order
            z = z * jnp.asarray(parts[0], z.dtype)
            xbc = xbc * jnp.asarray(per_channel, xbc.dtype)
            dt = dt * parts[4]
        w = self.conv[...].astype(dt_)
        if isinstance(context, Segments):
            xbc, valid = segment_conv(xbc, w, context.segment_ids), None
        else:
            valid = context.valid
            xbc, window = window_conv(xbc, w, context.window[..., 0], valid)
        xbc = jax.nn.silu(xbc + self.conv_bias[...].astype(dt_))
        per_group = xbc.reshape(bsz, t, g, -1).astype(jnp.float32)  # group by group: x, B, C (`grouped_channels`)
        xs = per_group[..., :h // g * p].reshape(bsz, t, h, p)
        b, c = (jnp.repeat(per_group[..., h // g * p + j * n:h // g * p + (j + 1) * n], h // g, axis=2)
                for j in range(2))  # [B, T, H, N]: each head's group's
        dt = jax.nn.softplus(dt + self.dt_bias[...].astype(jnp.float32))
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        if valid is None:
            y, _ = ssd(xs, dt, a, b, c, context.segment_ids)
        else:
            dt = jnp.where(valid[..., None], dt, 0.0)
            state = context.state.reshape(bsz, h, p, n)
            if t == 1:
                y, state = ssd_step(xs[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], state)
                y = y[:, None]
            else:
                y, state = ssd(xs, dt, a, b, c, state=state)
            context.store(window[..., None].astype(context.window.dtype), state.reshape(context.state.shape))
        y = (y + xs * self.D[...].astype(jnp.float32)[:, None]).reshape(bsz, t, h * p).astype(dt_)
        gate = jax.nn.silu(z.astype(jnp.float32))
        out = y.astype(jnp.float32) if m.norm == "before_gate" else y.astype(jnp.float32) * gate
        if m.norm is not None:  # RMS-normalised group by group
            grouped = out.reshape(bsz, t, g, -1)
            normed = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + self.eps)
            out = normed.reshape(bsz, t, h * p) * self.norm_scale[...].astype(jnp.float32)
            out = out * gate if m.norm == "before_gate" else out
        return project(out.astype(dt_), self.out_proj, dt_)


Mixer = Mamba2Mixer
