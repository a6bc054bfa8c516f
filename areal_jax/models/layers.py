"""Building blocks: RMSNorm, grouped-query attention, gated MLP, decoder layer (rotary embeddings: models.rope).

Every parameter is an `nnx.Param` annotated with logical axis names (see sharding.py) through its
`out_sharding` metadata. Parameters are stored in `cfg.param_dtype` and cast to `cfg.dtype` on use.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.attention_sinks import sink_softmax
from areal_jax.models.config import ModelConfig
from areal_jax.models.rope import apply_rope, deinterleave

MASK_VALUE = -1e30  # large negative logit for masked attention entries (scores are float32)


def make_param(rngs: nnx.Rngs | None, shape: tuple[int, ...], names: tuple[str | None, ...], dtype: jnp.dtype,
               init: str = "normal", std: float = 0.02) -> nnx.Param:
    """Creates a parameter with logical axis names. init: "normal" (N(0, std)), "zeros" or "ones"."""
    if len(names) != len(shape):
        raise ValueError(f"Axis names {names} do not match shape {shape}.")
    if init == "normal":
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        raise ValueError(f"Unknown initializer {init!r}.")
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float, offset: bool = False) -> jax.Array:
    """x: [..., D] any float dtype; scale: [D] (None: no scale). Normalises in float32 and returns x's dtype; with
    offset the factor is 1 + scale (Gemma's form, its weights stored as the offset from one)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if scale is None:
        return y.astype(x.dtype)
    factor = scale.astype(jnp.float32)
    return (y * (1.0 + factor if offset else factor)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis with a learned scale (initialised to the identity: ones, or
    zeros with `offset`, where the factor is 1 + scale); `weightless`: none (NanoChat's norms)."""

    def __init__(self, dim: int, eps: float, param_dtype: jnp.dtype, offset: bool = False, weightless: bool = False):
        self.eps = eps
        self.offset = offset
        self.scale = None if weightless else make_param(None, (dim,), ("norm",), param_dtype,
                                                        init="zeros" if offset else "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, None if self.scale is None else self.scale[...], self.eps, self.offset)


class LayerNorm(nnx.Module):
    """Layer norm over the last axis (mean removed, then divided by the standard deviation), a learned scale and,
    with `bias`, a learned bias (ones and zeros at first): PhiMoE's; Cohere's without the bias; OLMo's with neither
    (`weightless`); with `offset` the factor is 1 + scale (zeros at first: Nemotron's LayerNorm1P). Normalises in
    float32 and returns x's dtype."""

    def __init__(self, dim: int, eps: float, param_dtype: jnp.dtype, bias: bool = True, weightless: bool = False,
                 offset: bool = False):
        self.eps = eps
        self.offset = offset
        self.scale = None if weightless else make_param(None, (dim,), ("norm",), param_dtype,
                                                        init="zeros" if offset else "ones")
        self.bias = make_param(None, (dim,), ("norm",), param_dtype, init="zeros") if bias and not weightless else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + self.eps)
        factor = None if self.scale is None else self.scale[...].astype(jnp.float32)
        y = y if factor is None else y * (1.0 + factor if self.offset else factor)
        return (y if self.bias is None else y + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def make_norm(cfg: ModelConfig) -> RMSNorm | LayerNorm:
    """A norm over the hidden size of the model's kind: `LayerNorm` where `ModelConfig.layer_norm`, else `RMSNorm`."""
    if cfg.layer_norm:
        return LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, cfg.norm_bias, cfg.weightless_norms,
                         cfg.norm_offset)
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype, cfg.norm_offset, cfg.weightless_norms)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """Gemma 2's soft-capping, cap * tanh(x / cap), of float32 scores or logits; x itself when cap is None."""
    return x if cap is None else jnp.tanh(x / np.float32(cap)) * np.float32(cap)


def _group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """q: [B, T, H, Dh] -> [B, T, K, H // K, Dh]: query head h = k * group + g uses key/value head k."""
    b, t, h, dh = q.shape
    if h % kv_heads:
        raise ValueError(f"{h} query heads cannot share {kv_heads} key/value heads; num_heads must be a multiple "
                         "of num_kv_heads.")
    return q.reshape(b, t, kv_heads, h // kv_heads, dh)


def dot_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                  softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention over whole sequences (the packed, cache-free path) with a float32 softmax.

    q: [B, T, H, Dh]; k, v: [B, S, K, Dh] (H a multiple of K; key/value heads are shared by their query
    group through the einsum, never repeated); mask: [B, T, S] bool (True = may attend).
    Returns [B, T, H, Dh] in q's dtype. A query that may attend nothing gets the mean of v (zeros with sinks).
    softcap: the scaled scores' `soft_cap` (Gemma 2); sinks: [H] each query head's sink logit
    (`attention_sinks`), or None.
    """
    b, t, h, dh = q.shape
    qg = _group_queries(q, k.shape[2])
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = soft_cap(scores * np.float32(1.0 / math.sqrt(dh)), softcap)
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = sink_softmax(scores, sinks)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, dh).astype(q.dtype)


def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """Contract the last `n_in` axes of x with the first `n_in` axes of w, as one 2-D matmul.

    x: [..., *w.shape[:n_in]]; w: [*in, *out]. Returns [..., *out]. Tokens are flattened into rows and
    the weight into a matrix first: the same product as the einsum, but XLA's CPU backend then picks
    layouts whose backward needs no transposing copies (the MLP's forward + backward ran 1.8x faster
    at the benchmark size than with 3-D einsums); on accelerators it is the same dot.
    """
    lead, k_shape, out_shape = x.shape[: x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    if x.shape[x.ndim - n_in:] != k_shape:
        raise ValueError(f"dense: x {x.shape} does not end in w's input axes {k_shape} (w {w.shape}).")
    k = math.prod(k_shape)
    y = x.reshape(-1, k) @ w.reshape(k, -1)
    return y.reshape(*lead, *out_shape)


def project(x: jax.Array, w: nnx.Param | nnx.Module, dtype: jnp.dtype, n_in: int = 1) -> jax.Array:
    """A projection in the compute dtype: `dense(x, w)` for a parameter; a module with a `project` method
    (models.lora.LoRAProjection: a frozen weight plus a low-rank update) computes its own."""
    if isinstance(w, nnx.Variable):
        return dense(x, w[...].astype(dtype), n_in)
    return w.project(x, dtype, n_in)


class Attention(nnx.Module):
    """Multi-head attention with grouped key/value heads, optional q/k/v bias (Qwen2), q/k norm (Qwen3), o_proj bias
    `o_bias` [D] and per-head sink logits `sinks` [H] (gpt-oss: `attention_sinks`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k, hd, pdt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_dtype
        self.dtype = cfg.dtype
        self.eps = cfg.rms_norm_eps
        self.output_gate = cfg.gated_attention  # q_proj also gives each head's output gate
        self.q_proj = make_param(rngs, (d, h, 2 * hd if self.output_gate else hd), ("embed", "heads", "head_dim"), pdt)
        self.k_proj = make_param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), pdt)
        self.v_proj = make_param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), pdt)
        self.o_proj = make_param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), pdt)
        if cfg.attention_bias:
            self.q_bias = make_param(rngs, (h, hd), ("heads", "head_dim"), pdt, init="zeros")
            self.k_bias = make_param(rngs, (k, hd), ("kv_heads", "head_dim"), pdt, init="zeros")
            self.v_bias = make_param(rngs, (k, hd), ("kv_heads", "head_dim"), pdt, init="zeros")
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = make_param(rngs, (d,), ("embed",), pdt, init="zeros") if cfg.attention_out_bias else None
        self.sinks = make_param(rngs, (h,), ("heads",), pdt, init="zeros") if cfg.attention_sinks else None
        self.g_proj = make_param(rngs, (d, h), ("embed", "heads"), pdt) if cfg.head_gate else None  # LFM3
        if cfg.qk_norm:  # per head (Qwen3, Gemma 3), or over all heads together (OLMo, OLMoE)
            self.q_norm, self.k_norm = (RMSNorm(n * hd if cfg.flat_qk_norm else hd, cfg.rms_norm_eps, pdt,
                                                offset=cfg.norm_offset, weightless=cfg.weightless_norms) for n in (h, k))
        else:
            self.q_norm = self.k_norm = None
        self.flat_qk_norm = cfg.flat_qk_norm
        self.norm_after_rope = cfg.norm_after_rope
        self.clip = None if cfg.clip_qkv is None else float(cfg.clip_qkv)  # q, k and v clamped to [-clip, clip]
        self.query_factor = cfg.attention_scale_factor
        self.rope_interleave = cfg.rope_interleave

    def _project(self, x: jax.Array, w: nnx.Param | nnx.Module, bias: nnx.Param | None) -> jax.Array:
        y = project(x, w, self.dtype)
        y = y if bias is None else y + bias[...].astype(self.dtype)
        return y if self.clip is None else jnp.clip(y, -self.clip, self.clip)  # (OLMo's clip_qkv)

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cached: bool = False,
            query_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [B, T, D] -> q [B, T, H, Dh], k and v [B, T, K, Dh] in the compute dtype, RoPE applied to q, k.
        q comes times `ModelConfig.attention_scale_factor` (1 unless query_pre_attn_scalar != head_dim), so
        every attention path's 1 / sqrt(head_dim) gives the model's own scale, and times query_scale [B, T] where
        given (`rope.query_position_scale`: Ministral 3). cached (a KV-cache forward) changes nothing here (latent
        attention's form: `mla.MLAttention`)."""
        q = self._project(x, self.q_proj, self.q_bias)
        k = self._project(x, self.k_proj, self.k_bias)
        v = self._project(x, self.v_proj, self.v_bias)
        if not self.norm_after_rope:
            q, k = self._qk_norms(q, k)
        if self.rope_interleave:  # pairs to halves, queries and keys alike (their products unchanged)
            q, k = deinterleave(q, cos.shape[-1]), deinterleave(k, cos.shape[-1])
        if self.norm_after_rope:
            q, k = self._qk_norms(apply_rope(q, cos, sin), apply_rope(k, cos, sin))
        else:  # (this order keeps the other families' programs, and their compile-cache entries, as they were)
            q = apply_rope(q, cos, sin)
        if self.query_factor != 1.0:
            q = (q.astype(jnp.float32) * np.float32(self.query_factor)).astype(q.dtype)
        if query_scale is not None:  # in q's dtype, as transformers scales it
            q = q * query_scale.astype(q.dtype)[:, :, None, None]
        return q, k if self.norm_after_rope else apply_rope(k, cos, sin), v

    def gated_qkv(self, x: jax.Array, cos: jax.Array,
                  sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Qwen3.5's form of `qkv`: q_proj gives each head's query and then its output gate ([B, T, H, 2 Dh]);
        returns (q, k, v, gate [B, T, H, Dh]), the attention's output to be times sigmoid(gate)."""
        y = self._project(x, self.q_proj, self.q_bias)
        hd = y.shape[-1] // 2
        q, k = self._qk_norms(y[..., :hd], self._project(x, self.k_proj, self.k_bias))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), self._project(x, self.v_proj, self.v_bias), y[..., hd:]

    def _qk_norms(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.q_norm is not None and self.flat_qk_norm:
            return (self.q_norm(q.reshape(*q.shape[:2], -1)).reshape(q.shape),
                    self.k_norm(k.reshape(*k.shape[:2], -1)).reshape(k.shape))
        return (q, k) if self.q_norm is None else (self.q_norm(q), self.k_norm(k))

    def head_gated(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        """attn [B, T, H, Dh] times each head's sigmoid(x . g_proj) of the layer's input x [B, T, D] (`head_gate`)."""
        return attn if self.g_proj is None else attn * jax.nn.sigmoid(project(x, self.g_proj, self.dtype))[..., None]

    def out(self, attn: jax.Array, cached: bool = False) -> jax.Array:
        """attn: [B, T, H, Dh] -> [B, T, D] (plus o_bias where the model has one)."""
        y = project(attn, self.o_proj, self.dtype, n_in=2)
        return y if self.o_bias is None else y + self.o_bias[...].astype(self.dtype)


def xielu(x: jax.Array, alpha_p: jax.Array, alpha_n: jax.Array, beta: jax.Array, eps: jax.Array) -> jax.Array:
    """xIELU (arXiv 2411.13010; Apertus' MLP activation), in x's dtype: a_p x^2 + beta x for x > 0, else
    a_n (expm1(min(x, eps)) - x) + beta x, with a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n). beta and
    eps are constants of the checkpoint (transformers' buffers): no gradient reaches them."""
    beta, eps = jax.lax.stop_gradient(beta).astype(x.dtype), jax.lax.stop_gradient(eps).astype(x.dtype)
    a_p = jax.nn.softplus(alpha_p.astype(jnp.float32)).astype(x.dtype)
    a_n = (beta.astype(jnp.float32) + jax.nn.softplus(alpha_n.astype(jnp.float32))).astype(x.dtype)
    return jnp.where(x > 0, a_p * x * x + beta * x, (jnp.expm1(jnp.minimum(x, eps)) - x) * a_n + beta * x)


class MLP(nnx.Module):
    """Gated feed-forward: down(act(x @ gate) * (x @ up)), act SiLU (SwiGLU) or, for Gemma, GELU with the tanh
    approximation (`ModelConfig.mlp_activation`); ungated (`gate_proj` None: Arcee's, StarCoder2's): down(act(x @ up)),
    act relu(x) ** 2, GELU (tanh-approximated, or exact: GPT-NeoX's) or `xielu` (Apertus', with its scalars). With `ModelConfig.mlp_bias` each projection adds its bias (`*_bias`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, pdt = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.dtype = cfg.dtype
        self.act = cfg.mlp_activation
        self.gate_proj = make_param(rngs, (d, f), ("embed", "mlp"), pdt) if cfg.gated_mlp else None
        self.up_proj = make_param(rngs, (d, f), ("embed", "mlp"), pdt)
        self.down_proj = make_param(rngs, (f, d), ("mlp", "embed"), pdt)
        bias = cfg.mlp_bias
        self.gate_bias = make_param(rngs, (f,), ("mlp",), pdt, "zeros") if bias and cfg.gated_mlp else None
        self.up_bias = make_param(rngs, (f,), ("mlp",), pdt, "zeros") if bias else None
        self.down_bias = make_param(rngs, (d,), ("embed",), pdt, "zeros") if bias else None
        s = cfg.hybrid_scales  # Falcon-H1's: the gate times mlp_gate before the activation, the output times mlp_down
        self.scales = None if s is None else (s.mlp_gate, s.mlp_down)
        if self.act == "xielu":  # its per-layer scalars, stored as transformers does (alpha_p, alpha_n pre-softplus)
            init = dict(xielu_alpha_p=((1,), math.log(math.expm1(0.8))), xielu_alpha_n=((1,), math.log(math.expm1(0.3))),
                        xielu_beta=((), 0.5), xielu_eps=((), -1e-6))
            for name, (shape, value) in init.items():
                setattr(self, name, nnx.Param(jnp.full(shape, value, pdt), out_sharding=(None,) * len(shape),
                                              eager_sharding=False))

    def _activate(self, up: jax.Array) -> jax.Array:
        """An ungated MLP's activation of its up projection."""
        if self.act == "relu2":
            return jnp.square(jax.nn.relu(up))
        if self.act == "xielu":
            return xielu(up, *(getattr(self, f"xielu_{n}")[...] for n in ("alpha_p", "alpha_n", "beta", "eps")))
        return jax.nn.gelu(up, approximate=self.act != "gelu")

    def _project(self, x: jax.Array, w: nnx.Param | nnx.Module, bias: nnx.Param | None) -> jax.Array:
        y = project(x, w, self.dtype)
        return y if bias is None else y + bias[...].astype(self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, T, D] -> [B, T, D] in the compute dtype."""
        up = self._project(x, self.up_proj, self.up_bias)
        if self.gate_proj is None:
            return self._project(self._activate(up), self.down_proj, self.down_bias)
        gate = self._project(x, self.gate_proj, self.gate_bias)
        gate = gate if self.scales is None else gate * jnp.asarray(self.scales[0], gate.dtype)
        act = jax.nn.gelu(gate, approximate=True) if self.act == "gelu_tanh" else jax.nn.silu(gate)
        out = self._project(act * up, self.down_proj, self.down_bias)
        return out if self.scales is None else out * jnp.asarray(self.scales[1], out.dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h)); Gemma also normalises the attention's and the
    MLP's outputs before adding them (`post_attn_norm`, `post_ffn_norm`; its pre-MLP norm is `pre_ffn_norm`), and
    OLMo normalises only those outputs (no `input_norm`, no `pre_ffn_norm`). Elsewhere `post_attn_norm` is the
    pre-MLP norm (HF's post_attention_layernorm in every case). moe: the feed-forward is a mixture of experts
    (`models.moe.MoE`) rather than one MLP. linear: the token mixer is a stateful one (`linear_attn`: Gated
    DeltaNet, a short convolution or Mamba-2, `models.mixers`), not attention (`attn` None). hybrid: both, side by
    side on the same normed input, their outputs summed (Falcon-H1, with `ModelConfig.hybrid_scales`' multipliers).
    mlp False: no feed-forward and no norm before it (`mlp`, `post_attn_norm` None: `ModelConfig.mlp_layers`).
    Cohere's parallel form (`ModelConfig.parallel_block`): h + attn(norm(h)) + mlp(norm(h)), one norm for both;
    GPT-NeoX's: h + attn(norm(h)) + mlp(norm'(h)), the MLP's norm its own (`post_attn_norm`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False, linear: bool = False,
                 mlp: bool = True, hybrid: bool = False):
        from areal_jax.models.mixers import kind  # noqa: PLC0415 (they build on this module)
        from areal_jax.models.mla import MLAttention  # noqa: PLC0415
        from areal_jax.models.moe import MoE  # noqa: PLC0415

        olmo = cfg.olmo and not linear  # (OLMo Hybrid's Gated DeltaNet layers are pre-norm)
        self.input_norm = None if olmo else make_norm(cfg)
        self.linear_attn = kind(cfg).Mixer(cfg, rngs=rngs) if linear or hybrid else None
        s = cfg.hybrid_scales if hybrid else None  # (attention_in, attention_out, ssm_out)
        self.hybrid = None if not hybrid else (1.0, 1.0, 1.0) if s is None else (s.attention_in, s.attention_out,
                                                                                   s.ssm_out)
        self.attn = None if linear else MLAttention(cfg, rngs=rngs) if cfg.mla is not None else Attention(cfg, rngs=rngs)
        self.parallel = cfg.parallel_block
        self.post_attn_norm = make_norm(cfg) if mlp and (not self.parallel or cfg.parallel_mlp_norm) else None
        self.mlp = None if not mlp else MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)
        self.pre_ffn_norm = make_norm(cfg) if cfg.sandwich_norms else None
        self.post_ffn_norm = make_norm(cfg) if cfg.sandwich_norms or olmo else None
        self.residual_multiplier = cfg.residual_multiplier  # Granite: each branch's output times it before the add
        self.norm_input = cfg.dtype if cfg.residual_in_fp32 else None  # a float32 stream, rounded for the norm

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, attend, router_mask: jax.Array | None = None,
                 routes: jax.Array | None = None, replay: bool = False, record: bool = False,
                 cached: bool = False, query_scale: jax.Array | None = None) -> Any:
        """x: [B, T, D] compute dtype; cos, sin: this layer's RoPE table [B, T, head_dim] (query_scale [B, T]: its
        queries' factor by position, `rope.query_position_scale`, or None); attend(q, k, v, sinks) ->
        [B, T, H, Dh]: the attention over whatever holds the keys (packed rows, a KV cache, pages), which the
        caller's function may also write; sinks: the layer's sink logits [H] float32, or None. routes [B, T, k],
        replay: a mixture-of-experts layer's given experts (`MoE.__call__`). With
        router_mask [B, T] or record returns (x, the experts' extras: `MoE.__call__`; None for a dense layer).
        cached: `attend` reads and writes a KV cache (the attention's cache form: `mla.MLAttention`); "fresh": the
        cache is empty and the tokens sit at positions 0..T-1, so latent attention attends in its expanded form and
        passes attend a fifth argument, the (k, v) rows the cache holds. A hybrid layer's attend is a pair: the
        attention's, then the mixer's context."""
        extras: list[dict] = []

        def ffn(h: jax.Array) -> jax.Array:
            if isinstance(self.mlp, MLP):
                return self.mlp(h)
            if router_mask is None and not record:
                return self.mlp(h, routes=routes, replay=replay)
            out, found = self.mlp(h, router_mask, routes=routes, replay=replay, record=record)
            extras.append(found)
            return out

        h = x if self.input_norm is None else self.input_norm(x if self.norm_input is None else x.astype(self.norm_input))
        if self.hybrid is not None:  # attention and the mixer side by side (Falcon-H1)
            attend, context = attend
            a_in, a_out, s_out = (jnp.asarray(v, h.dtype) for v in self.hybrid)
            a = self._attention(h * a_in, cos, sin, attend, cached, query_scale) * a_out + \
                self.linear_attn(h, context) * s_out
        elif self.linear_attn is not None:  # a stateful mixer: attend is its context (gated_deltanet.Segments / StateCache)
            a = self.linear_attn(h, attend)
        else:
            a = self._attention(h, cos, sin, attend, cached, query_scale)
        if self.mlp is None:  # the token mixer alone (Nemotron-H's mixer followed by another)
            x = x + a
        elif self.parallel:  # attention and the MLP on the same normed input (Cohere), or the MLP on its own (GPT-NeoX)
            x = x + a + ffn(h if self.post_attn_norm is None else self.post_attn_norm(x))
        elif self.residual_multiplier is not None:
            m = jnp.asarray(self.residual_multiplier, a.dtype)
            x = x + a * m
            x = x + ffn(self.post_attn_norm(x)) * m
        elif self.post_ffn_norm is None:
            x = x + a
            x = x + ffn(self.post_attn_norm(x))
        else:
            x = x + self.post_attn_norm(a)
            x = x + self.post_ffn_norm(ffn(x if self.pre_ffn_norm is None else self.pre_ffn_norm(x)))
        return x if router_mask is None and not record else (x, extras[0] if extras else None)

    def _attention(self, h: jax.Array, cos: jax.Array, sin: jax.Array, attend, cached: bool | str,
                   query_scale: jax.Array | None) -> jax.Array:
        """The attention's output [B, T, D] of normed input h (`__call__`'s arguments)."""
        if getattr(self.attn, "output_gate", False):
            q, k, v, gate = self.attn.gated_qkv(h, cos, sin)
            return self.attn.out(attend(q, k, v, None) * jax.nn.sigmoid(gate))
        q, k, v, *write = self.attn.qkv(h, cos, sin, cached) if query_scale is None else \
            self.attn.qkv(h, cos, sin, cached, query_scale)
        sinks = None if self.attn.sinks is None else self.attn.sinks[...].astype(jnp.float32)
        o = attend(q, k, v, sinks, *write)
        return self.attn.out(self.attn.head_gated(h, o) if getattr(self.attn, "g_proj", None) is not None else o, cached)
