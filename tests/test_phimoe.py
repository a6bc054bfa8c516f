"""PhiMoE (PhimoeForCausalLM) against HF transformers (PyTorch, float32): the sparsemixer router against transformers'
own function (weights, picks and gradients), the logits on every expert path, with a window, the LongRoPE long
factors with their mscale, checkpoint round trips (LayerNorm and lm_head biases), what the released config says, and
the vocabulary projection's bias in the trainer's chunked log-probs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import Transformer, load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import read_safetensors_dir
from areal_jax.models.routing import Scoring, replay_weights, route
from areal_jax.testing.hf import hf_logits, random_tokens, randomize_torch
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.trainer.logprobs import chunked_logprobs

torch = pytest.importorskip("torch", reason="parity tests need PyTorch (pip install areal_jax[parity])")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers (areal_jax[parity])")

pytestmark = pytest.mark.parity

SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_local_experts=4,
             num_experts_per_tok=2, attention_bias=True, lm_head_bias=True, max_position_embeddings=256,
             original_max_position_embeddings=32)
SHORT, LONG = [1.0, 1.1, 1.3, 1.8, 2.5, 3.0, 3.5, 4.0], [1.0, 1.5, 2.7, 5.0, 9.0, 16.0, 20.0, 24.0]


def _rope(short=SHORT, long=LONG, short_mscale=1.2, long_mscale=1.35):
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": list(short), "long_factor": list(long),
            "short_mscale": short_mscale, "long_mscale": long_mscale, "original_max_position_embeddings": 32}


def _hf_model(path, seed=0, **kw):
    """transformers' PhimoeForCausalLM from its own config class (not our config.json writer), random O(1)
    weights (LayerNorm scales near 1, biases N(0, 0.1)), saved to `path`."""
    torch.manual_seed(seed)
    config = transformers.PhimoeConfig(**{**SHAPE, "rope_parameters": _rope(), "router_jitter_noise": 0.3, **kw})
    model = randomize_torch(transformers.PhimoeForCausalLM(config).to(torch.float32).eval(), seed)
    model.save_pretrained(path)
    return model


def _hf_sparsemixer():
    from transformers.models.phimoe import modeling_phimoe

    return modeling_phimoe.sparsemixer


@pytest.mark.parametrize("jitter", [0.01, 0.3])
def test_sparsemixer_weights_picks_and_gradients_match_transformers(jitter):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 6)).astype(np.float32) * np.float32(rng.choice([0.1, 1.0, 4.0], size=(64, 1)))
    logits[:8] -= 3.0  # all negative: the margin's max(|l|, t) takes |l|
    logits[8:16, 1] = logits[8:16, 0] * (1 - jitter)  # a second logit just inside the margin of the first
    u = rng.normal(size=(64, 2)).astype(np.float32)
    scores = torch.tensor(logits, requires_grad=True)
    weights, experts = _hf_sparsemixer()(scores, jitter_eps=jitter, training=False)
    (weights * torch.tensor(u)).sum().backward()

    scoring = Scoring("sparsemixer", jitter=jitter)
    ours, picks = route(jnp.asarray(logits), 2, False, scoring)
    np.testing.assert_array_equal(np.asarray(picks), experts.numpy())
    np.testing.assert_allclose(np.asarray(ours), weights.detach().numpy(), atol=1e-6, rtol=0)
    kept = (np.asarray(ours) < 0.999).mean()
    assert kept > (0.3 if jitter == 0.3 else 0.05)  # the margin keeps other experts in the softmax for many tokens
    grad = jax.grad(lambda x: jnp.sum(jnp.asarray(u) * route(x, 2, False, scoring)[0]))(jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(grad), scores.grad.numpy(), atol=1e-6, rtol=0)
    # the trainer's router replay gives the sampler's own picks the same weights
    np.testing.assert_allclose(np.asarray(replay_weights(jnp.asarray(logits), picks, False, scoring)), np.asarray(ours),
                               atol=0, rtol=0)


@pytest.mark.parametrize("extra", [{}, {"sliding_window": 7},  # and without LongRoPE (cos and sin unscaled)
                                   {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}])
def test_logits_match_transformers_on_every_expert_path(tmp_path, extra):
    hf = _hf_model(tmp_path, seed=1, **extra)
    ours = load_hf_checkpoint(tmp_path)
    cfg = ours.cfg
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.router_scoring, cfg.router_jitter) == (
        "phimoe", 4, 2, "sparsemixer", 0.3)
    assert cfg.layer_norm and cfg.lm_head_bias and cfg.attention_bias and cfg.attention_out_bias
    assert not cfg.norm_topk_prob and cfg.sliding_window == extra.get("sliding_window")
    assert (cfg.rope_scaling is None) == ("rope_parameters" in extra)
    assert ours.layers[0].input_norm.bias is not None and ours.lm_head_bias is not None
    tokens = random_tokens(cfg.vocab_size, (2, 30), seed=2)  # within original_max_position_embeddings (32)
    ref = hf_logits(hf, tokens)
    assert np.abs(ref).max() > 1.0
    for impl in ("blocked", "dense", "ragged"):
        model = Transformer(cfg.replace(moe_impl=impl), rngs=nnx.Rngs(0))
        nnx.update(model, nnx.state(ours))
        np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    # every bias has teeth: the norms', the attention's output and the logits'
    for holder, name in ((ours.layers[1].post_attn_norm, "bias"), (ours.layers[0].attn, "o_bias"), (ours, "lm_head_bias")):
        param = getattr(holder, name)
        kept = param[...]
        param.set_value(kept + jnp.linspace(-0.5, 0.5, kept.shape[0]))  # (a constant would pass a LayerNorm by)
        assert np.abs(np.asarray(ours(jnp.asarray(tokens))) - ref).max() > 1e-2, name
        param.set_value(kept)
    router = ours.layers[1].mlp.router
    router.set_value(-router[...])
    assert np.abs(np.asarray(ours(jnp.asarray(tokens))) - ref).max() > 1e-2


def test_long_factors_take_the_long_mscale(tmp_path):
    """Past original_max_position_embeddings a run takes the long factors with long_mscale; transformers 5 there
    keeps its short factors with long_mscale, so it is given the long factors as its short ones to compare."""
    hf = _hf_model(tmp_path / "hf", seed=4, rope_parameters=_rope(short=LONG))
    ours = load_hf_checkpoint(tmp_path / "hf", max_len=64)
    s = ours.cfg.rope_scaling
    assert s["use_long_factor"] and list(s["long_factor"]) == LONG and s["long_mscale"] == 1.35
    source = load_hf_checkpoint(tmp_path / "hf")  # the file's own short factors (here the long ones) for reference
    assert not source.cfg.rope_scaling["use_long_factor"]
    tokens = random_tokens(ours.cfg.vocab_size, (2, 48), seed=5)
    ref = hf_logits(hf, tokens)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    # the scale matters: the short mscale with the same factors gives other logits
    other = Transformer(ours.cfg.replace(rope_scaling={**s, "long_mscale": 1.2}), rngs=nnx.Rngs(0))
    nnx.update(other, nnx.state(ours))
    assert np.abs(np.asarray(other(jnp.asarray(tokens))) - ref).max() > 1e-3


def test_hf_to_ours_to_hf_is_byte_identical_and_loads_back(tmp_path):
    _hf_model(tmp_path / "hf", seed=3)
    ours = load_hf_checkpoint(tmp_path / "hf")
    save_hf_checkpoint(ours, tmp_path / "ours")
    src, out = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "ours")
    assert set(src) == set(out) and "lm_head.bias" in out and "model.norm.bias" in out
    assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in out
    for name in src:
        assert np.array_equal(src[name], out[name]), name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(back).__name__ == "PhimoeForCausalLM" and back.config.router_jitter_noise == 0.3
    tokens = random_tokens(ours.cfg.vocab_size, (2, 20), seed=6)
    np.testing.assert_allclose(hf_logits(back, tokens), np.asarray(ours(jnp.asarray(tokens))), atol=1e-4, rtol=0)
    assert load_hf_checkpoint(tmp_path / "ours").cfg == ours.cfg


def test_a_config_of_ours_loads_in_transformers_with_equal_logits():
    cfg = tiny_config("phimoe", num_layers=3)
    ours = random_model(cfg, seed=7)
    d = cfg.to_hf_dict()
    hf_cfg = transformers.PhimoeConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    hf = transformers.PhimoeForCausalLM(hf_cfg).eval()
    state = {name: torch.tensor(np.asarray(v)) for name, v in _hf_tensors(ours).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    tokens = random_tokens(cfg.vocab_size, (2, 24), seed=8)
    np.testing.assert_allclose(hf_logits(hf, tokens), np.asarray(ours(jnp.asarray(tokens))), atol=1e-4, rtol=0)


def _hf_tensors(model):
    """Our model's tensors under transformers' in-memory names (its experts fused: gate_up_proj [E, 2F, D],
    down_proj [E, D, F]; the router under mlp.router)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(model, d)
        tensors = read_safetensors_dir(d)
    out, cfg = {}, model.cfg
    for name, value in tensors.items():
        if ".experts." in name:
            continue
        out[name.replace(".block_sparse_moe.gate.", ".mlp.router.")] = value
    for i in range(cfg.num_layers):
        base = f"model.layers.{i}.block_sparse_moe.experts"
        w = {k: np.stack([tensors[f"{base}.{j}.{k}.weight"] for j in range(cfg.num_experts)]) for k in ("w1", "w2", "w3")}
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([w["w1"], w["w3"]], axis=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = w["w2"]
    return out


PHI_35_MOE = {  # microsoft/Phi-3.5-MoE-instruct's config.json (its factor lists shortened to their length here)
    "architectures": ["PhiMoEForCausalLM"], "model_type": "phimoe", "attention_bias": True, "bos_token_id": 1,
    "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 4096, "input_jitter_noise": 0.01,
    "intermediate_size": 6400, "lm_head_bias": True, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 16,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "rope_scaling": {"type": "longrope", "long_mscale": 1.243163121016122, "short_mscale": 1.243163121016122,
                     "original_max_position_embeddings": 4096, "short_factor": [1.0] * 64,
                     "long_factor": [1.0 + i for i in range(64)]},
    "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.01, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32064}


def test_the_released_config_and_its_refusals():
    cfg = ModelConfig.from_hf_dict(PHI_35_MOE)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.head_dim, cfg.sliding_window) == (
        "phimoe", 16, 2, 128, None)  # a window as long as the context changes nothing
    assert cfg.router_jitter == 0.01 and cfg.lm_head_bias and cfg.attention_out_bias and cfg.eos_token_id == 32000
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["original_max_position_embeddings"] == 4096
    # 41.9B parameters, 6.6B of them active a token (Phi-3.5-MoE's model card)
    assert abs(cfg.num_params / 1e9 - 41.87) < 0.01
    active = cfg.matmul_params_per_token + 2 * cfg.vocab_size * cfg.hidden_size
    assert abs(active / 1e9 - 6.6) < 0.05
    for change, words in (({"num_experts_per_tok": 4}, "always picks 2"),
                          ({"rope_scaling": {**PHI_35_MOE["rope_scaling"], "type": "yarn", "factor": 4.0}}, "'yarn'"),
                          ({"rope_scaling": {k: v for k, v in PHI_35_MOE["rope_scaling"].items() if k != "long_mscale"}},
                           "long_mscale"),
                          ({"mlp_bias": True}, "no biases"), ({"hidden_act": "gelu"}, "PhiMoE's")):
        with pytest.raises(ValueError, match=words):
            ModelConfig.from_hf_dict({**PHI_35_MOE, **change})
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        cfg.replace(norm_topk_prob=True)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        cfg.replace(tie_word_embeddings=True)
    with pytest.raises(ValueError, match="PhiMoE's; HF mixtral"):
        tiny_config("mixtral", lm_head_bias=True).to_hf_dict()


def test_chunked_logprobs_take_the_logits_bias_with_its_gradient():
    keys = jax.random.split(jax.random.key(0), 6)
    h, w = jax.random.normal(keys[0], (2, 13, 8)), jax.random.normal(keys[1], (8, 11))
    b, targets = jax.random.normal(keys[2], (11,)), jax.random.randint(keys[3], (2, 13), 0, 11)
    u, v = jax.random.normal(keys[4], (2, 13)), jax.random.normal(keys[5], (2, 13))

    def plain(h, w, b):
        logp = jax.nn.log_softmax(h @ w + b)
        return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], -jnp.sum(jnp.exp(logp) * logp, -1)

    def loss(fn):
        return lambda h, w, b: jnp.sum(u * fn(h, w, b)[0] + v * fn(h, w, b)[1])

    chunked = lambda h, w, b: chunked_logprobs(h, w, targets, 4, bias=b)  # noqa: E731 (13 is not a multiple of 4)
    for got, want in zip(chunked(h, w, b), plain(h, w, b)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    grads = jax.grad(loss(chunked), argnums=(0, 1, 2))(h, w, b)
    for got, want in zip(grads, jax.grad(loss(plain), argnums=(0, 1, 2))(h, w, b)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    assert float(jnp.abs(grads[2]).max()) > 0.1


def test_bfloat16_logits_stay_close_to_transformers(tmp_path):
    """bf16 weights and compute on both sides, the released margin (0.01); a pick near a tie or at the margin may
    differ in bf16 (transformers tests the margin in bf16 arithmetic, ours in float32 of the bf16 logits) and move a
    token's logits by ~2, so the check is on most positions (95-100% here over two seeds; the median gap 0.03-0.04)."""
    hf = _hf_model(tmp_path, seed=9, router_jitter_noise=0.01).to(torch.bfloat16)
    ours = load_hf_checkpoint(tmp_path, param_dtype=jnp.bfloat16)
    tokens = random_tokens(ours.cfg.vocab_size, (2, 30), seed=10)
    got, want = np.asarray(ours(jnp.asarray(tokens)), np.float32), hf_logits(hf, tokens)
    close = np.abs(got - want).max(-1) < 0.1 * np.abs(want).max()
    assert close.mean() > 0.9
