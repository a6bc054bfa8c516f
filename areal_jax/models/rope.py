"""Rotary position embeddings in HF's convention: each layer's tables (`rope_tables`), the inverse frequencies with
their scalings (linear, llama3, YaRN, LongRoPE), and the rotation of queries and keys (`apply_rope`, partial rotary
embeddings and interleaved pairs too)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, table: str = "global") -> np.ndarray:
    """Inverse frequencies [d // 2] float32 (d = `ModelConfig.rope_dim`): theta^(-2i/d), with HF "linear", "llama3",
    "yarn", "longrope" or "proportional" (LFM3's global layers: the pairs past a fraction of the head not turning)
    scaling when configured. table "local": the sliding layers' own table
    (`cfg.rope_local_theta`, no scaling) where the model has one (`ModelConfig.layer_rope`)."""
    dim = cfg.rope_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    local = table == "local" and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    scaling = None if local else cfg.rope_scaling
    if scaling is None or scaling.get("rope_type") in ("default", "dynamic"):  # (dynamic: the default up to
        return inv_freq  # max_position_embeddings, the only lengths allowed: ModelConfig.for_sequence_length)
    if scaling["rope_type"] == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if scaling["rope_type"] == "proportional":  # the first partial_rotary_factor of the pairs turn (exponents over
        # the whole head), the others not at all; then divided by factor
        turning = int(float(scaling["partial_rotary_factor"]) * dim // 2)
        return (np.where(np.arange(dim // 2) < turning, inv_freq, 0) / np.float32(scaling.get("factor", 1.0))
                ).astype(np.float32)
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(cfg, inv_freq)
    if scaling["rope_type"] == "longrope":  # 1 / (factor_i * theta^(2i/d)), in float32 as transformers computes it
        factors = np.asarray(scaling["long_factor" if scaling["use_long_factor"] else "short_factor"], np.float32)
        return (np.float32(1.0) / (factors * (np.float32(theta) ** exponent))).astype(np.float32)
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> dict[str, tuple[jax.Array, ...]]:
    """positions [B, T] -> {table: (cos, sin)} for each RoPE table the model's layers read
    (`ModelConfig.layer_rope`: "global"; "local" where sliding layers have a base of their own; "none", cos 1 and
    sin 0, where layers do not rotate). A model whose queries are scaled by position (`query_position_scale`:
    Ministral 3) gets (cos, sin, that scale [B, T]) instead."""
    names = sorted({cfg.layer_rope(i) for i in range(cfg.num_layers)})
    tables = {}
    for n in names:
        if n == "none":
            shape = (*positions.shape, cfg.head_dim)
            tables[n] = (jnp.ones(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
        else:
            cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg, n), rope_attention_scale(cfg, n))
            tables[n] = (cos, -sin) if cfg.rope_reversed else (cos, sin)
    scale = query_position_scale(cfg, positions)
    return tables if scale is None else {n: (*table, scale) for n, table in tables.items()}


def query_position_scale(cfg: ModelConfig, positions: jax.Array) -> jax.Array | None:
    """Ministral 3's queries (after RoPE) times 1 + beta ln(1 + floor(position / original_max_position_embeddings)),
    beta its rope parameters' llama_4_scaling_beta: [B, T] float32 (1 within the pretraining length, growing slowly
    past it; negative positions, which attend nothing, count as 0); None for every other model."""
    s = cfg.rope_scaling
    if cfg.architecture != "ministral3" or s is None or s.get("llama_4_scaling_beta") is None:
        return None
    blocks = jnp.floor(jnp.maximum(positions, 0).astype(jnp.float32) / np.float32(s["original_max_position_embeddings"]))
    return 1.0 + np.float32(s["llama_4_scaling_beta"]) * jnp.log1p(blocks)


def _yarn_inv_freq(cfg: ModelConfig, inv_freq: np.ndarray) -> np.ndarray:
    """YaRN (arXiv 2309.00071): the high-frequency dimensions (more than beta_fast rotations over the pretraining
    length) keep theta^(-2i/d), the low-frequency ones (fewer than beta_slow) are interpolated by 1 / factor, and a
    linear ramp over the dimension index blends the two in between, in float32 as transformers computes it."""
    s, dim, base = cfg.rope_scaling, cfg.rope_dim, float(cfg.rope_theta)
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dimension(rotations: float) -> float:  # the (fractional) dimension index that turns `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(fast), dimension(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1) - ramp).astype(np.float32)  # 1: extrapolate (the original frequency), 0: interpolate
    interpolated = (inv_freq / np.float32(factor)).astype(np.float32)
    return (interpolated * (np.float32(1) - keep) + inv_freq * keep).astype(np.float32)


def rope_attention_scale(cfg: ModelConfig, table: str = "global") -> float:
    """The factor cos and sin are multiplied by: 1, or with YaRN its attention_factor (by default
    0.1 ln(factor) + 1, or the ratio of the mscale / mscale_all_dim forms when both are given), with LongRoPE
    its attention_factor (by default sqrt(1 + ln(factor) / ln(original_max_position_embeddings))), or PhiMoE's
    short_mscale / long_mscale (the one of the factors in use) where the scaling has them."""
    s = cfg.rope_scaling
    if s is None or s.get("rope_type") not in ("yarn", "longrope") or (table == "local" and
                                                                       cfg.rope_local_theta is not None):
        return 1.0
    if s["rope_type"] == "longrope" and "short_mscale" in s:
        return float(s["long_mscale" if s.get("use_long_factor") else "short_mscale"])
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    if s["rope_type"] == "longrope":
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(s["original_max_position_embeddings"]))

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"])))
    return float(mscale())


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """positions: [B, T] int32 -> (cos, sin): [B, T, 2 * len(inv_freq)] float32 (frequencies repeated twice, HF
    layout), each times ``scale`` (rope_attention_scale)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if scale == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * jnp.float32(scale), jnp.sin(emb) * jnp.float32(scale)


def deinterleave(x: jax.Array, width: int | None = None) -> jax.Array:
    """x [..., d] whose first `width` (default all) dimensions hold rotary pairs (x0, x1), (x2, x3), ... -> the
    same with those as halves (x0, x2, ..., x1, x3, ...), the layout `apply_rope` rotates. Permuting queries and
    keys alike leaves their products unchanged (ERNIE 4.5's and DeepSeek's interleaved RoPE)."""
    width = x.shape[-1] if width is None else width
    rotary = x[..., :width]
    return jnp.concatenate([rotary[..., 0::2], rotary[..., 1::2], x[..., width:]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, N, head_dim]; cos/sin: [B, T, d] float32, d <= head_dim. x*cos + rotate_half(x)*sin on the first d
    dimensions (partial rotary embeddings: the rest pass through), in x's dtype."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :d], cos, sin), x[..., d:]], axis=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
