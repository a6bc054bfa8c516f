"""The decoder-only Transformer (Qwen2 / Qwen3 / Llama / Mistral / Gemma 3) with packed-sequence masks and a KV-cache
path."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.cache_attention import cached_attention, ring_attention, ring_length
from areal_jax.models.config import ModelConfig
from areal_jax.models.gated_deltanet import StateCache
from areal_jax.models.layers import DecoderLayer, make_norm, make_param, rms_norm, soft_cap
from areal_jax.models.mixers import kind
from areal_jax.models.mla import cache_layout, cached_values
from areal_jax.models.moe import moe_layer_count
from areal_jax.models.packed_attention import (  # noqa: F401 (re-export)
    decoder_layer,
    decoder_stack,
    layer_attention,
    packed_attention,
    packed_mask,
)
from areal_jax.models.rope import rope_tables


@dataclasses.dataclass
class LayerBuffers:
    """Keys and values, one buffer per layer (the dense cache's `KVCache`, the paged cache's `PagedKVCache`)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    def __post_init__(self) -> None:
        # jax.tree_util also rebuilds the dataclass around non-array leaves (e.g. shardings, None); only
        # lists are turned into tuples.
        if isinstance(self.k, list):
            self.k = tuple(self.k)
        if isinstance(self.v, list):
            self.v = tuple(self.v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache(LayerBuffers):
    """Keys and values, one array per layer. k, v: tuples of num_layers arrays [B, S, num_kv_heads, head_dim]
    in the compute dtype (latent attention: k [B, S, 1, kv_lora_rank + rope], v [B, S, 1, 0]: `mla.cache_layout`).

    Row b's entry at index s holds the token written at position s (see `Transformer.__call__`). Each layer
    is its own buffer, so a decode step writes it in place and attends to it directly (one stacked
    [L, B, S, ...] array made XLA:CPU copy a layer out of the stack per layer per step: 1.19x slower at
    256 slots x 88 positions of the default model).

    A sliding layer's buffer may be a *ring* shorter than the others (`init_cache(ring=True)`): it holds position
    p at index p % R, only its window's worth (`cache_attention.ring_attention`)."""

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def max_len(self) -> int:
        """Positions of the longest layer buffer (a ring layer's is shorter)."""
        return max(x.shape[1] for x in self.k)

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """(k, v) as [L, B, S, K, Dh] arrays (a copy)."""
        return jnp.stack(self.k), jnp.stack(self.v)


def cache_dtype(cfg: ModelConfig, backend: str | None = None) -> jnp.dtype:
    """The dtype a KV cache holds: the compute dtype, except float32 on the CPU (backend defaults to JAX's).

    XLA:CPU converts a 16-bit cache to float32 around every scatter into it and every attention read of it (a
    copy of the whole cache per layer and step): a decode step over a bf16 cache of 64 x 4,096 positions took
    322 ms against 13 ms with a float32 cache, the model computing in bf16 either way. Keys and values come out
    of bf16 projections, so a float32 cache holds them exactly."""
    dtype = jnp.dtype(cfg.dtype)
    backend = jax.default_backend() if backend is None else backend
    return jnp.dtype(jnp.float32) if backend == "cpu" and dtype.itemsize < 4 else dtype


def cache_lengths(cfg: ModelConfig, max_len: int, ring: bool = False) -> tuple[int, ...]:
    """Positions of each layer's cache buffer: max_len, or with ``ring`` a sliding layer's `ring_length` (its
    window, rounded up to a multiple of 8, when that is shorter than max_len)."""
    return tuple(max_len if not ring or cfg.layer_window(i) is None else ring_length(cfg.layer_window(i), max_len)
                 for i in range(cfg.num_layers))


def ring_layers(cfg: ModelConfig, max_len: int) -> tuple[int, ...]:
    """The layers whose ring (`cache_lengths` with ring) is shorter than max_len: those a sampler keeps as rings."""
    return tuple(i for i, n in enumerate(cache_lengths(cfg, max_len, ring=True)) if n < max_len)


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype: Any = None, ring: bool = False) -> KVCache:
    """A zero KV cache for `batch_size` rows of `max_len` positions; dtype defaults to `cache_dtype(cfg)`. ring:
    sliding layers hold only their window, as rings (`cache_lengths`; decode with ``ring=True`` then)."""
    if batch_size <= 0 or max_len <= 0:
        raise ValueError(f"init_cache needs positive batch_size and max_len, got {batch_size} and {max_len}.")
    return zero_cache(cfg, batch_size, cache_lengths(cfg, max_len, ring), dtype)


def zero_cache(cfg: ModelConfig, rows: int, lengths: Any, dtype: Any = None) -> KVCache:
    """A zero KVCache of `rows` rows, layer i holding lengths[i] positions in `mla.cache_layout`'s heads and widths
    (a stateful layer: its window and state, `mixers`' state_buffers; a hybrid layer: its keys and values, its window
    and state in entry `ModelConfig.state_entry`); dtype defaults to `cache_dtype(cfg)`."""
    dtype = cache_dtype(cfg) if dtype is None else dtype
    heads, k_dim, v_dim = cache_layout(cfg)
    if not cfg.recurrent:  # (its own branch: the buffers keep the order, and programs the lowering, of before)
        return KVCache(k=tuple(jnp.zeros((rows, n, heads, k_dim), dtype) for n in lengths),
                       v=tuple(jnp.zeros((rows, n, heads, v_dim), dtype) for n in lengths))
    buffers = kind(cfg).state_buffers
    pairs = [buffers(cfg, rows) if cfg.layer_is_linear(i) else
             (jnp.zeros((rows, n, heads, k_dim), dtype), jnp.zeros((rows, n, heads, v_dim), dtype))
             for i, n in enumerate(lengths[:cfg.num_layers])]
    pairs += [buffers(cfg, rows) for i in range(cfg.num_layers) if cfg.layer_is_hybrid(i)]
    return KVCache(k=tuple(k for k, _ in pairs), v=tuple(v for _, v in pairs))


def cached_layer(layer: DecoderLayer, x: jax.Array, rope: tuple, attend: Any, picks: list | None,
                 cached: bool | str = True) -> jax.Array:
    """One decoder layer of a cache forward (``attend`` writes and reads the cache; cached: `DecoderLayer`'s); with
    ``picks`` (a list) an expert layer appends the experts it sent each token to, [B, T, k]."""
    cos, sin, *scale = rope  # (cos, sin) or, with queries scaled by position, (cos, sin, scale): `rope_tables`
    if picks is None:
        return layer(x, cos, sin, attend, cached=cached, **({"query_scale": scale[0]} if scale else {}))
    x, extras = layer(x, cos, sin, attend, record=True, cached=cached, **({"query_scale": scale[0]} if scale else {}))
    if extras is not None:
        picks.append(extras["routes"])
    return x


def state_layer(layer: DecoderLayer, x: jax.Array, rope: tuple, ks: list, vs: list, i: int, positions: jax.Array,
                picks: list | None, attend: Any = None, cached: bool | str = True) -> jax.Array:
    """Gated DeltaNet layer i of a cache forward (dense cache or pages): its window and state are ks[i] and vs[i]
    (lists, replaced by the new ones); tokens at negative positions leave them as they are. A hybrid layer (its
    `attend` given; i its `ModelConfig.state_entry`): its attention's beside them."""
    context = state_context(ks, vs, i, positions)
    return cached_layer(layer, x, rope, context if attend is None else (attend, context), picks, cached)


def state_context(ks: list, vs: list, i: int, positions: jax.Array) -> StateCache:
    """A stateful mixer's cache context over entry i of the lists ks, vs (its window, its state; replaced by the new
    ones); tokens at negative positions leave them as they are."""

    def store(window: jax.Array, state: jax.Array) -> None:
        ks[i], vs[i] = window, state

    return StateCache(ks[i], vs[i], positions >= 0, store)


def logits_divisor(cfg: ModelConfig) -> float | None:
    """What the logits are divided by: Granite's logits_scaling, 1 / Falcon-H1's lm_head_multiplier, or None."""
    if cfg.hybrid_scales is not None and cfg.hybrid_scales.lm_head != 1.0:
        return 1.0 / cfg.hybrid_scales.lm_head
    return cfg.logits_scaling


def stacked_routes(picks: list[jax.Array], b: int, t: int) -> jax.Array:
    """Expert layers' picks ([B, T, k] each, in layer order) as one [B, T, L_moe, k] int32 array."""
    if not picks:
        raise ValueError("record_routes needs a mixture-of-experts model: this one has no expert layers.")
    return jnp.stack(picks, axis=2).astype(jnp.int32).reshape(b, t, len(picks), -1)


class Transformer(nnx.Module):
    """Decoder-only language model.

    Parameters (logical axes in brackets): embedder.embedding [vocab, embed]; per layer (in `layers`, an
    nnx.List) attention q/k/v/o projections, optional q/k/v bias and q/k norm, SwiGLU MLP (or a mixture of
    experts: models.moe) and two RMSNorms (LayerNorms: `ModelConfig.layer_norm`); lm_head_bias [vocab] where set;
    final_norm [norm]; lm_head [embed, vocab] unless the embeddings are tied.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = make_param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, moe=cfg.layer_is_moe(i), linear=cfg.layer_is_linear(i),
                                             mlp=cfg.layer_has_mlp(i), hybrid=cfg.layer_is_hybrid(i))
                                for i in range(cfg.num_layers)])
        self.final_norm = make_norm(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = make_param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)
        self.lm_head_bias = make_param(rngs, (cfg.vocab_size,), ("vocab",), cfg.param_dtype, init="zeros") \
            if cfg.lm_head_bias else None

    # ------------------------------------------------------------------ public API
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, *, ring: bool = False) -> jax.Array | tuple[jax.Array, KVCache]:
        """Logits [B, T, vocab] float32; with a cache, returns (logits, new_cache).

        tokens: [B, T] int32. positions: [B, T] int32 (RoPE positions; default 0..T-1 per row).
        Without a cache: token i attends to j iff j <= i and segment_ids[b, i] == segment_ids[b, j]
        (segment_ids default all ones; id 0 marks padding).
        With a cache: each token's key/value is written at index positions[b, t] of row b (indices outside
        [0, S) are dropped), then a query at position p attends to cache indices 0..p of its row (all S for
        p >= S; none for p < 0, giving a zero attention output). A sliding layer (`ModelConfig.layer_window`)
        also drops keys more than its window behind the query, in both modes. The cache path reads each layer in chunks
        up to the largest position in the batch (`cache_attention.cached_attention`) and is forward-only.
        ring: the sliding layers' buffers are rings (`init_cache(ring=True)`; one token per row).
        A Gated DeltaNet layer (Qwen3.5) keeps a state in place of positions (`gated_deltanet`): with a cache its
        tokens must come in order, each once; a token at a negative position leaves it as it is.
        """
        out = self.hidden(tokens, positions, segment_ids, cache, ring=ring)
        if cache is None:
            return self.unembed(out)
        h, new_cache = out
        return self.unembed(h), new_cache

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
               cache: KVCache | None = None, *, attention: str = "auto",
               remat: str = "none", scan_layers: bool = False, ring: bool = False,
               router_stats: bool = False, routes: jax.Array | None = None, replay: bool = False,
               record_routes: bool = False, fresh: bool = False) -> jax.Array | tuple[jax.Array, Any]:
        """Final-norm hidden states h: [B, T, hidden_size] in the compute dtype (and the new cache if given).

        attention, remat, scan_layers: the cache-free (training) forward's attention backend, per-layer
        rematerialisation and whether its layers run as one scan (models.packed_attention.decoder_stack);
        the cache path ignores them. ring: as in `__call__`. The mixture-of-experts layers (cache-free only):
        routes [B, T, L_moe, k] int32 gives experts for each token in each of them, which with replay the tokens go
        to (`moe.MoE`'s rollout routing replay); with router_stats or record_routes returns (h, their extras, or
        None for a dense model): "stats" (router_stats) [L_moe, 2, E] `moe.router_stats` over the real tokens
        (segment id > 0), "agree" (router_stats and routes) [L_moe] how many of those tokens' own top-k picks are
        among the given routes, "routes" (record_routes) [B, T, L_moe, k] the experts each token went to. With a
        cache, record_routes returns (h, new cache, those routes) (the prefill's and decode's own experts: a sampler
        records them for routing replay, `sampler.routes`). fresh: the cache is empty and every row's positions are
        0..T-1 (a prefill from scratch), so latent attention attends over this call's expanded keys and values (a
        third of the absorbed form's work per pair at DeepSeek's shapes) and caches only its latent.
        """
        cfg = self.cfg
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}.")
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        positions = jnp.asarray(positions, jnp.int32)
        if positions.shape != (b, t):
            raise ValueError(f"positions has shape {positions.shape}, expected {(b, t)} like tokens.")
        moe_layers = moe_layer_count(cfg)
        if routes is not None:
            routes = jnp.asarray(routes, jnp.int32)
            want = (b, t, moe_layers, cfg.num_experts_per_tok)
            if cache is not None or routes.shape != want:
                raise ValueError(f"routes must be [batch, time, mixture-of-experts layers, experts per token] = {want} "
                                 f"in the cache-free forward, got {routes.shape}"
                                 f"{' with a KV cache' if cache is not None else ''}.")
        if fresh and (cache is None or ring):
            raise ValueError("fresh=True describes a prefill into an empty (non-ring) KV cache: pass cache=init_cache("
                             "cfg, batch, length) and ring=False, or leave fresh off.")
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids cannot be combined with a KV cache: in cache mode a query at position p "
                                 "attends cache indices 0..p of its row. Pass one sequence per row instead.")
            got = [tuple(x.shape) for x in (*cache.k, *cache.v)]
            s = max((g[1] for g in got if len(g) == 4), default=None)
            rings = ring and cfg.sliding_window is not None
            lengths = cache_lengths(cfg, s or 0, rings)
            expected = [tuple(x.shape) for x in jax.tree.leaves(jax.eval_shape(lambda: zero_cache(cfg, b, lengths)))]
            if len(cache.k) != cfg.cache_entries or len(cache.v) != cfg.cache_entries or got != expected:
                raise ValueError(f"KV cache has {len(cache.k)} / {len(cache.v)} entries of shapes {sorted(set(got))}, "
                                 f"expected {cfg.cache_entries} of {sorted(set(expected))}; build it with "
                                 f"init_cache(cfg, batch_size={b}, max_len=..., ring={rings}).")
            if rings and t != 1:
                raise ValueError(f"a ring cache takes one token per row (decode), got {t}: prefill into "
                                 "init_cache(ring=False) and copy the rows in (sampler.prefill.write_rows).")
        else:
            if segment_ids is None:
                segment_ids = jnp.ones((b, t), jnp.int32)
            segment_ids = jnp.asarray(segment_ids, jnp.int32)
            if segment_ids.shape != (b, t):
                raise ValueError(f"segment_ids has shape {segment_ids.shape}, expected {(b, t)} like tokens.")
            attends = layer_attention(cfg, segment_ids, attention)  # masks built once, shared by the layers

        tables = rope_tables(cfg, positions)
        ropes = [tables[cfg.layer_rope(i)] for i in range(cfg.num_layers)]
        x = self.embed(tokens)
        if cache is None:
            per_layer = None if routes is None else jnp.moveaxis(routes, 2, 0)  # [L_moe, B, T, k]
            if router_stats or record_routes:
                h, extras = decoder_stack(self.layers, x, ropes, attends, remat, scan_layers,
                                          segment_ids > 0 if router_stats else None, per_layer, replay, record_routes)
                if extras is not None and "routes" in extras:
                    extras["routes"] = jnp.moveaxis(extras["routes"], 0, 2)
                return self.last_norm(h), extras
            return self.last_norm(decoder_stack(self.layers, x, ropes, attends, remat, scan_layers, routes=per_layer,
                                                 replay=replay))
        s = cache.max_len
        rows = jnp.arange(b)[:, None]
        write_at = jnp.where((positions >= 0) & (positions < s), positions, s)  # s: out of range -> dropped
        ks, vs = list(cache.k), list(cache.v)
        picks: list[jax.Array] = []  # record_routes: each expert layer's [B, T, k]
        for i, layer in enumerate(self.layers):
            if cfg.layer_is_linear(i):  # Gated DeltaNet: its window and state in place of keys and values
                x = state_layer(layer, x, ropes[i], ks, vs, i, positions, picks if record_routes else None)
                continue
            window = cfg.layer_window(i)
            r = ks[i].shape[1]
            at = jnp.where(positions >= 0, positions % r, r) if ring and window is not None else write_at

            def attend(q, k, v, sinks=None, write=None, i=i, window=window, at=at):
                ck, cv = (k, v) if write is None else write
                ks[i] = ks[i].at[rows, at].set(ck.astype(ks[i].dtype), mode="drop")
                vs[i] = vs[i].at[rows, at].set(cv.astype(vs[i].dtype), mode="drop")
                if write is not None:  # fresh: this call's own keys and values are the whole context
                    return cached_attention(q, k, v, positions, softcap=cfg.attn_logit_softcap, sinks=sinks)
                values = cached_values(ks[i], vs[i])
                if ring and window is not None:
                    return ring_attention(q, ks[i], values, positions, window, cfg.attn_logit_softcap, sinks)
                return cached_attention(q, ks[i], values, positions, window=window, softcap=cfg.attn_logit_softcap,
                                        sinks=sinks)

            routes_list, how = picks if record_routes else None, "fresh" if fresh else True
            if cfg.layer_is_hybrid(i):  # attention and the mixer side by side: the mixer's state in its own entry
                x = state_layer(layer, x, ropes[i], ks, vs, cfg.state_entry(i), positions, routes_list, attend, how)
                continue
            x = cached_layer(layer, x, ropes[i], attend, routes_list, how)
        out = self.last_norm(x), KVCache(k=tuple(ks), v=tuple(vs))
        return (*out, stacked_routes(picks, b, t)) if record_routes else out

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> the embeddings [B, T, D] in the compute dtype (Gemma: times sqrt(hidden_size); Granite:
        times embedding_multiplier; rounded to the parameter dtype as HF does); with residual_in_fp32 in float32, the
        residual stream's dtype (after that rounding)."""
        cfg = self.cfg
        x = jnp.take(self.embedding[...], tokens, axis=0)
        if cfg.gemma:
            x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
        if cfg.embedding_multiplier is not None:
            x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
        if cfg.embedding_norm:  # NanoChat's embeddings normalised (no scale) before the first layer
            x = rms_norm(x, None, cfg.rms_norm_eps)
        return x.astype(cfg.dtype).astype(jnp.float32 if cfg.residual_in_fp32 else cfg.dtype)

    def last_norm(self, x: jax.Array) -> jax.Array:
        """The final norm of the residual stream x, in the compute dtype (a float32 stream normalised in float32, then
        rounded, as transformers' Mamba models hand it to their lm_head)."""
        return self.final_norm(x).astype(self.cfg.dtype)

    def unembed_matrix(self) -> jax.Array:
        """[hidden_size, vocab] in the param dtype: the tied embedding transposed, or lm_head."""
        if self.lm_head is None:
            return self.embedding[...].T
        return self.lm_head[...]

    def unembed_bias(self) -> jax.Array | None:
        """[vocab] in the param dtype: the output logits' bias (`ModelConfig.lm_head_bias`), or None."""
        return None if self.lm_head_bias is None else self.lm_head_bias[...]

    def unembed(self, h: jax.Array) -> jax.Array:
        """h: [..., hidden_size] -> logits [..., vocab] float32 (plus lm_head's bias where the model has one; Granite:
        divided by `logits_divisor`; Gemma 2: soft-capped, `layers.soft_cap`)."""
        w = self.unembed_matrix().astype(self.cfg.dtype)
        logits = jnp.einsum("...d,dv->...v", h.astype(self.cfg.dtype), w, preferred_element_type=jnp.float32)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias[...].astype(jnp.float32)
        if logits_divisor(self.cfg) is not None:
            logits = logits / np.float32(logits_divisor(self.cfg))
        return soft_cap(logits, self.cfg.final_logit_softcap)
