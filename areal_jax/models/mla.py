"""Multi-head latent attention (DeepSeek-V2 / V3: `ModelConfig.mla`, shapes `MLA`).

Queries: x -> q_a_proj [D, Rq] -> RMSNorm -> q_b_proj [Rq, H, nope + rope] (or one q_proj [D, H, nope + rope] without
a query rank). Keys and values: x -> kv_a_proj [D, Rkv + rope], whose first Rkv columns are the latent (RMSNorm,
then kv_b_proj [Rkv, H, nope + v] gives each head's key part without rotation and its value) and whose last `rope`
columns are one rotary key shared by every head. Each head's query and key are [nope dims, rope dims] (transformers'
order), RoPE on the rope dims only; DeepSeek's checkpoints lay those out as interleaved pairs, which are taken apart
into halves first (`MLA.interleave`; the same permutation of queries and keys leaves their products unchanged).

Training (the cache-free forward) expands the latent: the layer looks like grouped-query attention with as many
key/value heads as query heads and head_dim = nope + rope, so the packed-row paths and the flash and splash kernels
run it as they are; values are padded with zeros from v to head_dim and cut back after attention.

With a KV cache (the sampler's prefill and decode: `cached=True`) the layer caches the latent instead, as one
key/value head of Rkv + rope dimensions (`cache_layout`): each head's key-side weights (kv_b_proj's first nope
columns) are absorbed into its query, q_nope @ W_k^T, so a query of Rkv + rope dimensions scores the cached
[latent, rotary key] directly (q_nope . (c W_k) = (q_nope W_k^T) . c); the value is that same cached row, and the
attention's output, a mix of latents, goes through each head's value weights (kv_b_proj's last v columns) before
o_proj. The cache keeps the keys only (values of width 0: `cache_layout`, `cached_values`), so every cache path
(dense, ring, pages) runs it as one-head attention whose values are its keys, and a position costs Rkv + rope cached
values a layer instead of 2 x H x (nope + rope): 576 against 6,144 at DeepSeek-V2-Lite's shape (10.7x less),
against 49,152 at V3's (85x).

A prefill into an empty cache (`cached="fresh"`: `Transformer.hidden(fresh=True)`, the sampler's prompts and
recomputes) attends in the expanded form, over the call's own keys and values, and caches the latent: the
projections cost the same, and each pair of positions scores nope + rope and mixes v dimensions instead of
Rkv + rope and Rkv (3.4x fewer attention FLOPs at DeepSeek's shapes: `benchmarks/mla_prefill.py`).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.config_checks import MLA  # noqa: F401 (the shapes' type)
from areal_jax.models.layers import RMSNorm, make_param, project
from areal_jax.models.rope import apply_rope, deinterleave


def cache_layout(cfg: ModelConfig) -> tuple[int, int, int]:
    """(key/value heads, key dimensions, value dimensions) per head of a layer's KV cache: the model's own, or latent
    attention's one head of kv_lora_rank + rope keys (the latent and the rotary key) and no values of their own (the
    keys serve as values: `cached_values`)."""
    if cfg.mla is None:
        return cfg.num_kv_heads, cfg.head_dim, cfg.head_dim
    return 1, cfg.mla.kv_lora_rank + cfg.mla.rope, 0


def cached_values(k: Any, v: Any) -> Any:
    """The values a cache layer attends with: its own, or its keys where it holds none (latent attention)."""
    return k if v.shape[-1] == 0 else v


def _weight(w: Any, dtype: Any) -> jax.Array:
    """A projection's weight in `dtype`, a LoRA-adapted one's with its adapters folded in."""
    return w[...].astype(dtype) if isinstance(w, nnx.Variable) else w.merged(dtype)


class MLAttention(nnx.Module):
    """The attention of a latent-attention layer, with `layers.Attention`'s interface (`qkv`, `out`, `sinks`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m, d, h, pdt = cfg.mla, cfg.hidden_size, cfg.num_heads, cfg.param_dtype
        self.dtype, self.shape, self.head_dim = cfg.dtype, m, cfg.head_dim
        qk = m.nope + m.rope
        if m.q_lora_rank is None:
            self.q_proj = make_param(rngs, (d, h, qk), ("embed", "heads", "head_dim"), pdt)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = make_param(rngs, (d, m.q_lora_rank), ("embed", None), pdt)
            self.q_a_norm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps, pdt)
            self.q_b_proj = make_param(rngs, (m.q_lora_rank, h, qk), (None, "heads", "head_dim"), pdt)
        self.kv_a_proj = make_param(rngs, (d, m.kv_lora_rank + m.rope), ("embed", None), pdt)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps, pdt)
        self.kv_b_proj = make_param(rngs, (m.kv_lora_rank, h, m.nope + m.v), (None, "heads", "head_dim"), pdt)
        self.o_proj = make_param(rngs, (h, m.v, d), ("heads", "head_dim", "embed"), pdt)
        self.sinks = None
        self.query_factor = cfg.attention_scale_factor

    def _rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        return apply_rope(deinterleave(x) if self.shape.interleave else x, cos, sin)

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cached: bool | str = False) -> tuple:
        """x: [B, T, D] -> q, k, v [B, T, H, head_dim] in the compute dtype (v zero past its own width); cos, sin:
        the rope dims' table [B, T, rope]. q comes times `ModelConfig.attention_scale_factor` (YaRN's mscale_all_dim
        squared, else 1). cached: the latent form (module docstring): q [B, T, H, Rkv + rope], k [B, T, 1, Rkv +
        rope] and v [B, T, 1, 0] (the keys serve as values), q scaled so that the paths' 1 / sqrt(Rkv + rope) gives
        the model's scale."""
        m = self.shape
        if self.q_proj is not None:
            q = project(x, self.q_proj, self.dtype)
        else:
            q = project(self.q_a_norm(project(x, self.q_a_proj, self.dtype)), self.q_b_proj, self.dtype)
        latent = project(x, self.kv_a_proj, self.dtype)
        c = self.kv_a_norm(latent[..., :m.kv_lora_rank])
        k_rope = self._rope(latent[:, :, None, m.kv_lora_rank:], cos, sin)  # [B, T, 1, rope], shared by the heads
        q_rope = self._rope(q[..., m.nope:], cos, sin)
        factor = self.query_factor
        fresh = cached == "fresh"
        latent_kv = jnp.concatenate([c[:, :, None, :], k_rope], axis=-1) if cached else None  # the cache's row
        if cached and not fresh:
            w_k = _weight(self.kv_b_proj, self.dtype)[..., :m.nope]  # [Rkv, H, nope]
            q_latent = jnp.einsum("bthn,rhn->bthr", q[..., :m.nope], w_k, preferred_element_type=jnp.float32)
            q = jnp.concatenate([q_latent.astype(self.dtype), q_rope], axis=-1)
            k, v = latent_kv, latent_kv[..., :0]  # the cache keeps no values: its keys serve (`cached_values`)
            factor *= float(np.sqrt((m.kv_lora_rank + m.rope) / self.head_dim))
        else:
            kv = project(c, self.kv_b_proj, self.dtype)  # [B, T, H, nope + v]
            q = jnp.concatenate([q[..., :m.nope], q_rope], axis=-1)
            k = jnp.concatenate([kv[..., :m.nope], jnp.broadcast_to(k_rope, (*kv.shape[:3], m.rope))], axis=-1)
            v = kv[..., m.nope:]
            if m.v < self.head_dim:
                v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, self.head_dim - m.v)))
        if factor != 1.0:
            q = (q.astype(jnp.float32) * np.float32(factor)).astype(q.dtype)
        return (q, k, v, (latent_kv, latent_kv[..., :0])) if fresh else (q, k, v)

    def out(self, attn: jax.Array, cached: bool | str = False) -> jax.Array:
        """attn: [B, T, H, head_dim] -> [B, T, D] (the values' own width of it); cached (not "fresh"): [B, T, H,
        Rkv + rope], a mix of latents, through each head's value weights first."""
        m = self.shape
        if cached and cached != "fresh":
            w_v = _weight(self.kv_b_proj, self.dtype)[..., m.nope:]  # [Rkv, H, v]
            attn = jnp.einsum("bthr,rhv->bthv", attn[..., :m.kv_lora_rank], w_v,
                              preferred_element_type=jnp.float32).astype(self.dtype)
        return project(attn[..., :m.v], self.o_proj, self.dtype, n_in=2)
