"""Model forward semantics: KV-cache decode, packed sequences, RoPE, GQA, config validation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import KVCache, ModelConfig, Transformer, init_cache
from areal_jax.models.mla import cache_layout
from areal_jax.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from areal_jax.testing.models import random_model, tiny_config

# gemma3, olmo3: a sliding layer (window 8) and a full one; smollm3: a layer without rotary embeddings; exaone4: a
# sliding layer and a full one without them; hunyuan_v1_dense: q/k norms after RoPE; qwen3_moe, mixtral, granitemoe,
# olmoe, qwen2_moe and granitemoeshared (with a shared expert): 2 of 4 experts per token; ministral3: queries scaled past each 8 positions;
# phimoe: LayerNorms, output biases, sparsemixer routing; flex_olmo: OLMo 2's layer with experts; falcon_h1: attention
# and Mamba-2 side by side in every layer
ARCHS = ["qwen2", "qwen3", "llama", "gemma2", "gemma3", "olmo2", "olmo3", "smollm3", "phi3", "qwen3_moe", "mixtral",
         "granite", "granitemoe", "granitemoeshared", "olmoe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "glm4_moe", "exaone4", "exaone_moe",
         "hunyuan_v1_dense", "hunyuan_v1_moe", "seed_oss", "arcee", "qwen3_5_text",
         "qwen3_5_moe_text", "ministral3", "qwen3_next", "phimoe", "flex_olmo", "lfm2", "lfm2_moe", "lfm3",
         "olmo_hybrid", "granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "jamba",
         "falcon_mamba", "mamba2", "cwm", "youtu", "nanochat", "cohere2", "starcoder2", "gpt_neox", "phi", "gemma", "glm", "helium", "ministral", "apertus", "stablelm", "exaone", "olmo", "jais2"]


def _jitted(model):
    graphdef, state = nnx.split(model)
    full = jax.jit(lambda st, tok, pos, seg: nnx.merge(graphdef, st)(tok, pos, seg))
    cached = jax.jit(lambda st, tok, pos, cache: nnx.merge(graphdef, st)(tok, pos, cache=cache))
    return state, full, cached


def _marked(archs, long):
    return [pytest.param(a, marks=pytest.mark.long) if a in long else a for a in archs]


# falcon_h1's and jamba's are long (7-12 s): tests/test_falcon_h1.py and tests/test_jamba.py decode them through the
# sampler, dense and over pages, against full forwards
@pytest.mark.parametrize("arch", _marked(ARCHS + ["qwen3-yarn"], {"falcon_h1", "jamba"}))
def test_kv_cache_decode_matches_full_forward(arch):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6}  # the decode runs past 6
    cfg = tiny_config("qwen3", rope_scaling=yarn) if arch == "qwen3-yarn" else tiny_config(arch)
    model = random_model(cfg, seed=1)
    state, full, cached = _jitted(model)
    rng = np.random.default_rng(0)
    total, bucket = 12, 8
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, total)), jnp.int32)
    ones = jnp.ones((2, total), jnp.int32)
    ref = full(state, tokens, jnp.broadcast_to(jnp.arange(total), (2, total)), ones)
    # float32 against float32 in another order: within a few units of rounding of the largest logit (the Gated DeltaNet
    # models' logits reach 7-9, their chunked rule against its token recurrence 5e-6 to 1.4e-5 apart)
    atol = max(1e-5, 3e-6 * float(jnp.abs(ref).max()))

    # Prefill a padded bucket: row 0 has a 3-token prompt, row 1 a 6-token prompt; the tail is junk.
    lengths = np.array([3, 6])
    prompt = np.asarray(tokens[:, :bucket]).copy()
    for b, n in enumerate(lengths):
        prompt[b, n:] = rng.integers(0, cfg.vocab_size, bucket - n)
    cache = init_cache(cfg, 2, 16)
    positions = np.broadcast_to(np.arange(bucket), (2, bucket))
    if cfg.recurrent:  # a stateful layer (Gated DeltaNet, short convolution) takes each token once, in order: the tail is padding
        positions = np.where(positions < lengths[:, None], positions, -1)
    logits, cache = cached(state, jnp.asarray(prompt), jnp.asarray(positions, jnp.int32), cache)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :n], ref[b, :n], atol=atol, rtol=0)

    # Token-by-token decode, each row at its own position.
    pos = lengths.copy()
    while pos.max() < total:
        step_pos = np.minimum(pos, total - 1)
        step_tok = np.asarray(tokens)[np.arange(2), step_pos][:, None]
        logits, cache = cached(state, jnp.asarray(step_tok), jnp.asarray(step_pos[:, None], jnp.int32), cache)
        for b in range(2):
            if pos[b] < total:
                np.testing.assert_allclose(logits[b, 0], ref[b, pos[b]], atol=atol, rtol=0)
        pos += 1
    assert isinstance(cache, KVCache) and len(cache.k) == len(cache.v) == cfg.cache_entries  # (hybrid: + states)
    heads, k_dim, v_dim = cache_layout(cfg)  # latent attention caches its latent: keys only
    attention = [i for i in range(cfg.num_layers) if not cfg.layer_is_linear(i)]
    assert {cache.k[i].shape for i in attention} <= {(2, 16, heads, k_dim)}  # (falcon_mamba, mamba2: no attention)
    assert {cache.v[i].shape for i in attention} <= {(2, 16, heads, v_dim)} and (attention or arch in ("falcon_mamba", "mamba2"))


# nemotron_h's, falcon_h1's and youtu's are long (8-16 s): their Mamba-2 layers' packed rows are bamba's and
# tests/test_granite4.py's (tests/test_falcon_h1.py checks a segment of a packed row alone), youtu's latent attention
# deepseek_v3's
@pytest.mark.parametrize("arch", _marked(ARCHS, {"nemotron_h", "falcon_h1", "youtu"}))
def test_packed_row_equals_sequences_alone(arch):
    cfg = tiny_config(arch)
    model = random_model(cfg, seed=2)
    state, full, _ = _jitted(model)
    rng = np.random.default_rng(1)
    lens = [3, 5, 4]
    seqs = [rng.integers(0, cfg.vocab_size, n) for n in lens]
    pad = 2
    tokens = np.concatenate(seqs + [np.zeros(pad, np.int64)])[None]
    positions = np.concatenate([np.arange(n) for n in lens] + [np.arange(pad)])[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)] + [np.zeros(pad, np.int64)])[None]
    # A second row holding the same sequences in another order, to check rows are independent.
    order = [2, 0, 1]
    tokens2 = np.concatenate([seqs[i] for i in order] + [np.ones(pad, np.int64)])[None]
    positions2 = np.concatenate([np.arange(lens[i]) for i in order] + [np.arange(pad)])[None]
    segments2 = np.concatenate([np.full(lens[i], 7 + j) for j, i in enumerate(order)] + [np.zeros(pad, np.int64)])
    packed = full(state, jnp.asarray(np.concatenate([tokens, tokens2]), jnp.int32),
                  jnp.asarray(np.concatenate([positions, positions2]), jnp.int32),
                  jnp.asarray(np.concatenate([segments, segments2[None]]), jnp.int32))
    starts = np.cumsum([0] + lens)
    alone = [np.asarray(model(jnp.asarray(s[None], jnp.int32)))[0] for s in seqs]
    atol = max(1e-5, 1e-6 * max(np.abs(a).max() for a in alone))  # (LFM2's tied embeddings: logits of up to ~35)
    for i in range(3):
        np.testing.assert_allclose(packed[0, starts[i]:starts[i + 1]], alone[i], atol=atol, rtol=0)
    off = 0
    for i in order:
        np.testing.assert_allclose(packed[1, off:off + lens[i]], alone[i], atol=atol, rtol=0)
        off += lens[i]


def test_long_packed_row_uses_blocked_attention_and_equals_sequences_alone():
    # A 384-token row takes the blocked path (models.blocked_attention: 128-token blocks, key blocks no
    # query may see skipped); each sequence alone (<= 150 tokens) takes dense attention.
    from areal_jax.models.blocked_attention import attention_block

    cfg = tiny_config("qwen2")
    model = random_model(cfg, seed=3)
    state, full, _ = _jitted(model)
    rng = np.random.default_rng(4)
    lens, pad = [100, 150, 60, 50], 24
    t = sum(lens) + pad
    assert attention_block(t) == 128 and all(attention_block(n) is None for n in lens)
    seqs = [rng.integers(0, cfg.vocab_size, n) for n in lens]
    tokens = np.concatenate(seqs + [np.zeros(pad, np.int64)])[None]
    positions = np.concatenate([np.arange(n) for n in lens] + [np.arange(pad)])[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)] + [np.zeros(pad, np.int64)])[None]
    packed = full(state, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                  jnp.asarray(segments, jnp.int32))
    starts = np.cumsum([0] + lens)
    for i, s in enumerate(seqs):
        alone = np.asarray(model(jnp.asarray(s[None], jnp.int32)))[0]
        np.testing.assert_allclose(packed[0, starts[i]:starts[i + 1]], alone, atol=1e-5, rtol=0)


def test_default_positions_and_segments():
    cfg = tiny_config("qwen3")
    model = random_model(cfg)
    tokens = jnp.asarray([[5, 9, 11, 3], [1, 2, 3, 4]], jnp.int32)
    explicit = model(tokens, jnp.asarray([[0, 1, 2, 3]] * 2, jnp.int32), jnp.ones((2, 4), jnp.int32))
    np.testing.assert_array_equal(model(tokens), explicit)
    # Causality: changing a later token never changes earlier logits.
    changed = model(tokens.at[:, 3].set(50))
    np.testing.assert_array_equal(changed[:, :3], explicit[:, :3])
    assert not np.allclose(changed[:, 3], explicit[:, 3])


def test_cache_writes_beyond_length_are_dropped():
    cfg = tiny_config("llama")
    model = random_model(cfg)
    cache = init_cache(cfg, 1, 4)
    _, cache = model(jnp.asarray([[3, 4]], jnp.int32), jnp.asarray([[0, 1]], jnp.int32), cache=cache)
    before = np.stack(cache.k)
    logits, after = model(jnp.asarray([[7]], jnp.int32), jnp.asarray([[9]], jnp.int32), cache=cache)
    np.testing.assert_array_equal(np.stack(after.k), before)
    assert np.isfinite(np.asarray(logits)).all()
    # Cache indices 2..3 are zero; a query at position 9 attends them like any other index.
    assert not np.any(before[:, :, 2:])


def test_unembed_matrix_chunked_matches_logits():
    for tied in (False, True):
        cfg = tiny_config("qwen2", tie_word_embeddings=tied)
        model = random_model(cfg)
        tokens = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
        logits = model(tokens)
        h = model.hidden(tokens)
        w = model.unembed_matrix()
        assert w.shape == (cfg.hidden_size, cfg.vocab_size)
        chunks = [h @ w[:, i:i + 32] for i in range(0, cfg.vocab_size, 32)]
        np.testing.assert_allclose(jnp.concatenate(chunks, -1), logits, atol=1e-5, rtol=0)
        if tied:
            assert model.lm_head is None
            np.testing.assert_array_equal(w, model.embedding[...].T)


def test_rope_matches_complex_rotation_and_is_relative():
    cfg = tiny_config("qwen2")
    inv_freq = rope_inv_freq(cfg)
    d = cfg.head_dim
    np.testing.assert_allclose(inv_freq, cfg.rope_theta ** (-np.arange(0, d, 2) / d), rtol=1e-6)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 3, 2, d)).astype(np.float32)
    positions = jnp.asarray([[0, 5, 17]], jnp.int32)
    cos, sin = rope_cos_sin(positions, inv_freq)
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    # HF pairs dimension i with i + d/2: rotate the complex number (x_i + j x_{i+d/2}) by angle p * f_i.
    z = x[..., : d // 2] + 1j * x[..., d // 2:]
    angle = np.asarray(positions)[..., None, None] * inv_freq.astype(np.float64)
    zr = z * np.exp(1j * angle)
    np.testing.assert_allclose(got, np.concatenate([zr.real, zr.imag], -1), atol=1e-5)
    # q(p) . k(p') depends only on p - p'.
    q, k = jnp.asarray(x[:, :1, :1]), jnp.asarray(x[:, 1:2, :1])

    def score(pq, pk):
        cq, sq = rope_cos_sin(jnp.asarray([[pq]]), inv_freq)
        ck, sk = rope_cos_sin(jnp.asarray([[pk]]), inv_freq)
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)


def test_llama3_scaling_leaves_high_frequencies_and_divides_low_ones():
    cfg = tiny_config("llama")
    plain = rope_inv_freq(cfg.replace(rope_scaling=None))
    scaled = rope_inv_freq(cfg)
    sc = cfg.rope_scaling
    wavelen = 2 * np.pi / plain
    high = wavelen < sc["original_max_position_embeddings"] / sc["high_freq_factor"]
    low = wavelen > sc["original_max_position_embeddings"] / sc["low_freq_factor"]
    assert high.any() and low.any()
    np.testing.assert_allclose(scaled[high], plain[high], rtol=1e-6)
    np.testing.assert_allclose(scaled[low], plain[low] / sc["factor"], rtol=1e-6)
    mid = ~high & ~low
    assert np.all(scaled[mid] <= plain[mid]) and np.all(scaled[mid] >= plain[mid] / sc["factor"])


def test_grouped_query_attention_equals_repeated_kv_heads():
    cfg = tiny_config("qwen2")
    gqa = random_model(cfg, seed=3)
    mha = Transformer(cfg.replace(num_kv_heads=cfg.num_heads), rngs=nnx.Rngs(0))
    src, dst = nnx.state(gqa, nnx.Param), nnx.state(mha, nnx.Param)
    group = cfg.num_heads // cfg.num_kv_heads

    def copy(path, dst_leaf):
        src_leaf = src
        for key in path:
            src_leaf = src_leaf[key.key] if hasattr(key, "key") else src_leaf.get_value()
        if src_leaf.shape == dst_leaf.shape:
            return src_leaf
        axis = 1 if src_leaf.ndim == 3 else 0  # k/v_proj [D, K, Dh] or k/v_bias [K, Dh]
        return jnp.repeat(src_leaf, group, axis=axis)

    nnx.update(mha, jax.tree_util.tree_map_with_path(copy, dst))
    tokens = jnp.asarray([[4, 8, 15, 16, 23, 42]], jnp.int32)
    np.testing.assert_allclose(mha(tokens), gqa(tokens), atol=1e-5, rtol=0)


def test_config_validation_and_hf_dict_round_trip():
    for arch, extra in [*((a, {}) for a in ARCHS), ("mistral", {}), ("mistral", {"sliding_window": 6}),
                        ("qwen2", {"sliding_window": 6, "layer_types": ("full_attention", "sliding_attention")}),
                        ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
                        ("qwen3_moe", {"moe_layers": (0, 1), "norm_topk_prob": False}),
                        ("mixtral", {"sliding_window": 6})]:
        cfg = tiny_config(arch, tie_word_embeddings=arch == "qwen3", eos_token_id=(2, 5), **extra)
        again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
        assert again == cfg and hash(again) == hash(cfg)
    with pytest.raises(ValueError, match="Unknown architecture"):
        tiny_config("gpt2")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config("qwen2", num_kv_heads=3)
    with pytest.raises(ValueError, match="Unknown architecture"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})  # (learned position embeddings: not supported)
    mistral = {"model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
               "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32768}
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": 4096}).layer_window(0) == 4096  # Mistral v0.1
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": 32768}).sliding_window is None  # as long: full
    with pytest.raises(ValueError, match="rope_scaling type 'ntk_tuned' is not supported"):
        tiny_config("llama", rope_scaling={"rope_type": "ntk_tuned", "factor": 4.0})
    dynamic = tiny_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0})  # the default RoPE within
    with pytest.raises(ValueError, match="dynamic NTK scaling"):  # max_position_embeddings, longer runs refused
        dynamic.for_sequence_length(dynamic.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        tiny_config("llama", rope_scaling={"rope_type": "longrope", "factor": 4.0})
    legacy = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
              "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 5e5,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16}}
    cfg = ModelConfig.from_hf_dict(legacy, dtype=jnp.bfloat16)
    assert cfg.head_dim == 4 and cfg.num_kv_heads == 2 and cfg.rope_theta == 5e5
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.dtype == jnp.bfloat16
    assert cfg.param_dtype == jnp.float32
