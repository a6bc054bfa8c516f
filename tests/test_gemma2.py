"""Gemma 2: tanh soft-capping of the attention scores in every attention path (training backends with their
gradients, KV cache, ring, pages and the paged kernels) against a NumPy loop, of the output logits in the trainer's
chunked log-probs (values and gradients), decoding through the sampler, and the model against HF transformers."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.blocked_attention import blocked_attention
from areal_jax.models.cache_attention import cached_attention, ring_attention
from areal_jax.models.flash_attention import flash_attention
from areal_jax.models.layers import dot_attention
from areal_jax.models.packed_attention import packed_mask
from areal_jax.models.paged_attention import PagedKVCache, gather_attention, kernel_attention
from areal_jax.models.splash import splash_attention
from areal_jax.testing import models as testing

CAP = 1.5


def reference(q, k, v, seg, window=None, cap=CAP):
    """Query i attends key j iff j <= i, i - j < window and both share a segment id; scores cap * tanh(s / cap)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, dh = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        for i in range(t):
            keys = [j for j in range(0 if window is None else max(0, i - window + 1), i + 1) if seg[r, j] == seg[r, i]]
            for head in range(h):
                s = np.array([q[r, i, head] @ k[r, j, head // group] for j in keys]) / math.sqrt(dh)
                s = cap * np.tanh(s / cap)
                p = np.exp(s - s.max())
                out[r, i, head] = (p / p.sum()) @ v[r, keys, head // group]
    return out


def _qkv(seed=0, b=2, t=32, h=4, kv=2, d=16, scale=2.0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(b, t, n, d)) * scale, jnp.float32) for n in (h, kv, kv))


def _segments():
    seg = np.ones((2, 32), np.int32)
    seg[0, 20:] = 2
    seg[1, 11:] = 2
    seg[1, 27:] = 3
    return seg


@pytest.mark.parametrize("window", [None, 6])
def test_training_paths_soft_cap_like_the_reference(window):
    """Dense, blocked, flash and splash (interpreted) with the cap and a window or none; scores large enough
    (q, k ~ N(0, 4)) that the cap changes them."""
    q, k, v = _qkv()
    seg = _segments()
    want = reference(q, k, v, seg, window)
    uncapped = reference(q, k, v, seg, window, cap=1e9)
    assert np.abs(want - uncapped).max() > 0.1  # the cap has teeth
    got = {
        "dense": dot_attention(q, k, v, packed_mask(jnp.asarray(seg), window), CAP),
        "blocked": blocked_attention(q, k, v, jnp.asarray(seg), 8, window=window, softcap=CAP),
        "flash": flash_attention(q, k, v, jnp.asarray(seg), block_q=16, block_k=16, window=window, softcap=CAP),
        "splash": splash_attention(q, k, v, jnp.asarray(seg), window=window, softcap=CAP),
    }
    for name, out in got.items():
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, err_msg=name)


def test_flash_gradients_with_the_cap_equal_the_dense_path():
    q, k, v = _qkv(seed=1)
    seg = jnp.asarray(_segments())
    w = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    mask = packed_mask(seg, 6)

    def loss(fn):
        return lambda q, k, v: jnp.sum(w * fn(q, k, v))

    dense = jax.grad(loss(lambda q, k, v: dot_attention(q, k, v, mask, CAP)), argnums=(0, 1, 2))(q, k, v)
    flash = jax.grad(loss(lambda q, k, v: flash_attention(q, k, v, seg, block_q=16, block_k=16, window=6,
                                                         softcap=CAP)), argnums=(0, 1, 2))(q, k, v)
    plain = jax.grad(loss(lambda q, k, v: dot_attention(q, k, v, mask)), argnums=(0, 1, 2))(q, k, v)
    for name, a, b, c in zip("qkv", dense, flash, plain):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=5e-5, err_msg=f"d{name}")
        if name != "v":
            assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-2  # the cap's derivative matters


def test_decode_paths_soft_cap_like_the_reference():
    """One query per row over a dense cache (chunked and windowed reads), a ring, pages (gather) and JAX's paged
    kernels (GPU's and TPU's, interpreted), all against the loop."""
    b, s, h, kv, d = 3, 48, 4, 2, 128
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.normal(size=(b, s, kv, d)) * 1.5, jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)) * 1.5, jnp.float32)
    pos = np.array([5, 30, 47])
    seg = np.ones((b, s), np.int32)

    def want(window=None):
        full_q = jnp.zeros((b, s, h, d)).at[jnp.arange(b), pos].set(q[:, 0])
        return reference(full_q, k, v, seg, window)[np.arange(b), pos][:, None]

    positions = jnp.asarray(pos[:, None], jnp.int32)
    np.testing.assert_allclose(np.asarray(cached_attention(q, k, v, positions, chunk_size=16, softcap=CAP)), want(),
                               atol=2e-5)
    np.testing.assert_allclose(np.asarray(cached_attention(q, k, v, positions, window=8, softcap=CAP)), want(8),
                               atol=2e-5)
    held = positions - jnp.remainder(positions - jnp.arange(8)[None], 8)
    ring_k = jnp.take_along_axis(k, jnp.clip(held, 0)[:, :, None, None], axis=1)
    ring_v = jnp.take_along_axis(v, jnp.clip(held, 0)[:, :, None, None], axis=1)
    np.testing.assert_allclose(np.asarray(ring_attention(q, ring_k, ring_v, positions, 8, CAP)), want(8), atol=2e-5)
    ps = 8
    table = jnp.asarray(rng.permutation(b * s // ps).reshape(b, s // ps), jnp.int32)
    pages = [jnp.zeros((kv, b * s // ps, ps, d)) for _ in range(2)]
    for r in range(b):
        for p in range(s // ps):
            for i, x in enumerate((k, v)):
                pages[i] = pages[i].at[:, table[r, p]].set(x[r, p * ps:(p + 1) * ps].transpose(1, 0, 2))
    cache = PagedKVCache(k=(pages[0],), v=(pages[1],))
    np.testing.assert_allclose(np.asarray(gather_attention(q, cache, 0, table, positions, softcap=CAP)), want(),
                               atol=2e-5)
    full_q = jnp.zeros((b, s, h, d)).at[jnp.arange(b), pos].set(q[:, 0])
    uncapped = reference(full_q, k, v, seg, cap=1e9)[np.arange(b), pos][:, None]
    assert np.abs(uncapped - want()).max() > 0.1  # the cap has teeth here
    for platform, atol in (("gpu", 1e-4), ("tpu", 2e-2)):  # the TPU kernel multiplies at bf16 precision
        got = kernel_attention(q, cache, 0, table, positions, interpret=True, platform=platform, softcap=CAP)
        np.testing.assert_allclose(np.asarray(got), want(), atol=atol, err_msg=platform)


def test_chunked_logprobs_soft_cap_the_logits_with_their_gradient():
    from areal_jax.trainer.logprobs import chunked_logprobs

    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.normal(size=(2, 13, 24)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(24, 50)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, (2, 13)), jnp.int32)
    cap = 2.0

    def direct(h, w):
        logits = cap * jnp.tanh((h @ w) / cap)
        logp = jax.nn.log_softmax(logits, -1)
        ent = -jnp.sum(jnp.exp(logp) * logp, -1)
        return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], ent

    lp, ent = chunked_logprobs(h, w, targets, chunk=4, softcap=cap)
    want_lp, want_ent = direct(h, w)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(want_ent), atol=1e-5)
    u = jnp.asarray(rng.normal(size=(2, 13)), jnp.float32)

    def loss(fn):
        return lambda h, w: jnp.sum(u * fn(h, w)[0]) + 0.3 * jnp.sum(fn(h, w)[1])

    got = jax.grad(loss(lambda h, w: chunked_logprobs(h, w, targets, chunk=4, softcap=cap)), argnums=(0, 1))(h, w)
    ref = jax.grad(loss(direct), argnums=(0, 1))(h, w)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


@pytest.mark.parametrize("paged", [False, True])
def test_sampler_decodes_gemma2_as_its_full_forward(paged):
    """A Gemma 2 model (soft caps, every other layer sliding, the sliding ones as rings) through the SamplerLoop:
    greedy completions past several windows equal greedy decoding by full forwards, with their log-probs."""
    from areal_jax.sampler.engine import Engine
    from areal_jax.sampler.paged_engine import PagedEngine
    from areal_jax.sampler.requests import Request
    from areal_jax.testing.sampler import full_forward_logp, greedy_reference, serve

    model = testing.random_model(testing.tiny_config("gemma2", num_layers=2), seed=3)
    _, params = nnx.split(model)
    engine = (PagedEngine(model, num_slots=2, max_len=40, page_size=4) if paged
              else Engine(model, num_slots=2, max_len=40))
    prompts = [[5, 9, 13, 2, 40, 41, 42, 43, 44, 45], [7, 30], [11, 12, 13]]
    done = serve(engine, params, [Request(id=i, prompt=p, max_new_tokens=20, temperature=0.0)
                                  for i, p in enumerate(prompts)], decode_steps=4)
    logp = full_forward_logp(model, 40)
    for completion, prompt in zip(done, prompts):
        tokens, lps, _ = greedy_reference(logp, prompt, 20)
        assert list(completion.tokens) == tokens
        np.testing.assert_allclose(completion.logprobs, lps, atol=1e-4)


@pytest.mark.parity
def test_gemma2_matches_transformers_and_round_trips(tmp_path):
    """Gemma2ForCausalLM at toy size with caps small enough to bite: our logits equal HF's; the checkpoint comes
    back byte for byte and transformers loads ours with the same logits; without the caps the logits differ."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from areal_jax.models import Transformer, load_hf_checkpoint, save_hf_checkpoint
    from areal_jax.models.hf_io import read_safetensors_dir
    from areal_jax.testing.hf import hf_logits, random_tokens, randomize_torch

    config = transformers.Gemma2Config(
        vocab_size=101, hidden_size=48, intermediate_size=88, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=5, max_position_embeddings=512, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=4.0, rope_theta=10000.0, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(config).to(torch.float32).eval()
    randomize_torch(hf, 5, norm_center=0.0)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf")
    cfg = ours.cfg
    assert cfg.architecture == "gemma2" and cfg.attn_logit_softcap == 2.0 and cfg.final_logit_softcap == 4.0
    assert [cfg.layer_window(i) for i in range(3)] == [5, None, 5] and not cfg.qk_norm and cfg.tie_word_embeddings
    tokens = random_tokens(101, (2, 30), seed=6)
    ref = hf_logits(hf, tokens)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    uncapped = Transformer(cfg.replace(attn_logit_softcap=None, final_logit_softcap=None), rngs=nnx.Rngs(0))
    nnx.update(uncapped, nnx.state(ours))
    assert np.abs(np.asarray(uncapped(jnp.asarray(tokens))) - ref).max() > 1e-2
    save_hf_checkpoint(ours, tmp_path / "ours")
    before, after = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "ours")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert tensor.tobytes() == after[name].tobytes(), name
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(again).__name__ == "Gemma2ForCausalLM" and again.config.attn_logit_softcapping == 2.0
    np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(hf, tokens))
    assert load_hf_checkpoint(tmp_path / "ours").cfg == cfg


def test_gemma2_config_layouts():
    """google/gemma-2-2b-it's config.json (the keys that matter), read as Gemma2ForCausalLM reads it."""
    from areal_jax.models.config import ModelConfig

    gemma_2b = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000,
                "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "max_position_embeddings": 8192, "rope_theta": 10000.0,
                "rms_norm_eps": 1e-6}
    cfg = ModelConfig.from_hf_dict(gemma_2b)
    assert [i for i in range(26) if cfg.layer_window(i) is None] == list(range(1, 26, 2))
    assert cfg.attn_logit_softcap == 50.0 and cfg.final_logit_softcap == 30.0 and cfg.tie_word_embeddings
    assert cfg.gemma and not cfg.qk_norm and cfg.rope_local_theta is None and cfg.attention_scale_factor == 1.0
    assert abs(cfg.num_params - 2_614_341_888) < 1  # 2.6B
    assert ModelConfig.from_hf_dict({**gemma_2b, "final_logit_softcapping": None}).final_logit_softcap is None
    with pytest.raises(ValueError, match="soft-capping is Gemma 2's"):
        testing.tiny_config("gemma3", attn_logit_softcap=5.0).to_hf_dict()
