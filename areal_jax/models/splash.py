"""Packed-row attention on TPU through JAX's Pallas splash-attention kernel (segment ids, causal or sliding-window
mask).

Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) computes one key/value head
against several query heads (its "MQA" form) with a static causal block mask and run-time segment
ids; grouped-query attention maps onto it by vmapping over batch rows and key/value heads, each call
taking the `group` query heads of one key/value head. Its backward is the kernel's own. Attention sinks
(`attention_sinks`) are the kernel's own too (its `sinks`: one logit per query head, gradient included). Rows are
padded to a multiple of 128 tokens (padding gets a segment of its own). `interpret=True` runs the
kernel in the Pallas TPU interpreter, which works on the CPU (tests).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def _block(t: int) -> int:
    """The largest of 512, 256, 128 dividing t (t a multiple of 128)."""
    return next(b for b in (512, 256, 128) if t % b == 0)


@functools.lru_cache(maxsize=32)
def _kernel(t: int, group: int, interpret: bool, window: int = 0, softcap: float = 0.0):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    def one() -> object:  # causal, or a window of `window` positions ending at the query (a causal local mask)
        return sm.LocalMask((t, t), window_size=(window - 1, 0), offset=0) if window else sm.CausalMask((t, t))

    mask = sm.MultiHeadMask([one() for _ in range(group)])
    b = _block(t)
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    with jax.ensure_compile_time_eval():  # the kernel's mask tables are constants, even when built under jit
        kernel = sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret,
                                                  attn_logits_soft_cap=softcap or None)
    return kernel, sk.SegmentIds


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                     interpret: bool | None = None, window: int | None = None,
                     softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention of packed rows with the splash kernel.

    q: [B, T, H, Dh]; k, v: [B, T, K, Dh]; segment_ids: [B, T] int (i attends j iff j <= i and both
    have the same id; with a sliding window also i - j < window: the kernel's local mask, whose block
    tables skip the blocks outside it). Returns [B, T, H, Dh] in q's dtype. interpret: default on any
    backend but TPU. softcap: Gemma 2's soft-capping of the scaled scores (the kernel's attn_logits_soft_cap).
    sinks: [H] each query head's sink logit (`attention_sinks`; float32), or None.
    """
    b, t, h, dh = q.shape
    kv = k.shape[2]
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != dh or h % kv:
        raise ValueError(f"splash_attention: q {q.shape}, k {k.shape}, v {v.shape}; expected q [B, T, H, Dh] and "
                         "k, v [B, T, K, Dh] with H a multiple of K.")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"splash_attention: sinks has shape {sinks.shape}, expected one logit per query head {(h,)}.")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    group = h // kv
    t_pad = -(-t // 128) * 128
    seg = jnp.asarray(segment_ids, jnp.int32)
    if t_pad != t:
        widths = ((0, 0), (0, t_pad - t), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        seg = jnp.concatenate([seg, jnp.broadcast_to(jnp.min(seg) - 1, (b, t_pad - t))], axis=1)
    kernel, segment_ids_type = _kernel(t_pad, group, bool(interpret), int(window or 0), float(softcap or 0.0))
    scale = jnp.asarray(1.0 / math.sqrt(dh), q.dtype)
    qg = (q * scale).reshape(b, t_pad, kv, group, dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, Dh]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, Dh]

    heads = None if sinks is None else sinks.astype(jnp.float32).reshape(kv, group)  # [K, G]

    def one_head(qh, kh, vh, s, sh):  # sinks passed only when given (older kernels take none)
        return kernel(qh, kh, vh, segment_ids=segment_ids_type(q=s, kv=s), **({} if sh is None else {"sinks": sh}))

    per_row = jax.vmap(one_head, in_axes=(0, 0, 0, None, 0))
    out = jax.vmap(per_row, in_axes=(0, 0, 0, 0, None))(qg, kt, vt, seg, heads)  # [B, K, G, T, Dh]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t_pad, h, dh)
    return out[:, :t].astype(q.dtype)
