"""Multi-head latent attention (DeepSeek-V2 / V3: `ModelConfig.mla`, shapes `MLA`).

Queries: x -> q_a_proj [D, Rq] -> RMSNorm -> q_b_proj [Rq, H, nope + rope] (or one q_proj [D, H, nope + rope] without
a query rank). Keys and values: x -> kv_a_proj [D, Rkv + rope], whose first Rkv columns are the latent (RMSNorm,
then kv_b_proj [Rkv, H, nope + v] gives each head's key part without rotation and its value) and whose last `rope`
columns are one rotary key shared by every head. Each head's query and key are [nope dims, rope dims] (transformers'
order), RoPE on the rope dims only; DeepSeek's checkpoints lay those out as interleaved pairs, which are taken apart
into halves first (`MLA.interleave`; the same permutation of queries and keys leaves their products unchanged).

The layer then looks like grouped-query attention with as many key/value heads as query heads and head_dim = nope +
rope, so every attention path (packed rows, flash and splash kernels, KV caches, pages) runs it as it is; values are
padded with zeros from v to head_dim and cut back after attention. The caches therefore hold each head's expanded
keys and values (2 x H x head_dim per token and layer) rather than the latent (Rkv + rope): simpler and exact, at
more cache memory per token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.config_checks import MLA  # noqa: F401 (the shapes' type)
from areal_jax.models.layers import RMSNorm, apply_rope, make_param, project


def deinterleave(x: jax.Array) -> jax.Array:
    """[..., d] with rotary pairs (x0, x1), (x2, x3), ... -> [..., d] as halves (x0, x2, ..., x1, x3, ...), the
    layout `layers.apply_rope` rotates."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


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

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [B, T, D] -> q, k, v [B, T, H, head_dim] in the compute dtype (v zero past its own width); cos, sin:
        the rope dims' table [B, T, rope]. q comes times `ModelConfig.attention_scale_factor` (YaRN's mscale_all_dim
        squared, else 1)."""
        m = self.shape
        if self.q_proj is not None:
            q = project(x, self.q_proj, self.dtype)
        else:
            q = project(self.q_a_norm(project(x, self.q_a_proj, self.dtype)), self.q_b_proj, self.dtype)
        latent = project(x, self.kv_a_proj, self.dtype)
        kv = project(self.kv_a_norm(latent[..., :m.kv_lora_rank]), self.kv_b_proj, self.dtype)  # [B, T, H, nope + v]
        k_rope = self._rope(latent[:, :, None, m.kv_lora_rank:], cos, sin)  # [B, T, 1, rope], shared by the heads
        q = jnp.concatenate([q[..., :m.nope], self._rope(q[..., m.nope:], cos, sin)], axis=-1)
        k = jnp.concatenate([kv[..., :m.nope], jnp.broadcast_to(k_rope, (*kv.shape[:3], m.rope))], axis=-1)
        v = kv[..., m.nope:]
        if m.v < self.head_dim:
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, self.head_dim - m.v)))
        if self.query_factor != 1.0:
            q = (q.astype(jnp.float32) * np.float32(self.query_factor)).astype(q.dtype)
        return q, k, v

    def out(self, attn: jax.Array) -> jax.Array:
        """attn: [B, T, H, head_dim] -> [B, T, D] (the values' own width of it)."""
        return project(attn[..., :self.shape.v], self.o_proj, self.dtype, n_in=2)
