"""DeepSeek-V3 (DeepseekV3ForCausalLM) and DeepSeek-V2 (DeepseekV2ForCausalLM): the released config.json files read
as transformers reads them, the routers (V3: sigmoid scores, picking bias, groups, scaling; V2: softmax, greedy or
within groups) against transformers' routers, latent attention and the whole models against transformers' logits,
checkpoint round trips both ways, the sampler against full forwards, and a training step's gradients on a 2 x 2
mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.models.config_checks import MLA
from areal_jax.models.routing import Scoring, route
from areal_jax.system.loadgen import shape_config
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens

DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3's config.json
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}}


DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite's config.json
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "ep_size": 1,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
    "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False, "scoring_func": "softmax",
    "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": False, "bos_token_id": 100000, "eos_token_id": 100001,
    "tie_word_embeddings": False, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                                   "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                                   "type": "yarn"}}


def test_released_configs_read_as_transformers_reads_them():
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    assert cfg.architecture == "deepseek_v3" and cfg.mla == MLA(1536, 512, 128, 64, 128, True)
    assert cfg.head_dim == 192 and cfg.num_kv_heads == 128 and cfg.rope_dim == 64
    assert cfg.router_scoring == "sigmoid" and cfg.router_groups == (8, 4) and cfg.router_score_bias
    assert cfg.routed_scaling_factor == 2.5 and cfg.shared_expert_size == 2048 and not cfg.shared_expert_gated
    assert [cfg.layer_is_moe(i) for i in range(5)] == [False, False, False, True, True]
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 40
    # softmax scale 192 ** -0.5 * (0.1 ln 40 + 1) ** 2 (transformers' yarn_apply_mscale): queries carry the square
    assert cfg.attention_scale_factor == pytest.approx((0.1 * np.log(40) + 1) ** 2)
    # the model card: 671B parameters in the main model (the multi-token-prediction module aside), 37B active
    assert round(cfg.num_params / 1e9) == 671
    assert 36e9 < cfg.matmul_params_per_token + 2 * cfg.vocab_size * cfg.hidden_size < 38e9
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    lite = ModelConfig.from_hf_dict({**DEEPSEEK_V3, "q_lora_rank": None, "n_group": 1, "topk_group": 1})
    assert lite.mla.q_lora_rank is None and lite.router_groups is None
    assert ModelConfig.from_hf_dict(lite.to_hf_dict()) == lite
    v2 = ModelConfig.from_hf_dict(DEEPSEEK_V2_LITE)
    assert v2.architecture == "deepseek_v2" and v2.mla == MLA(None, 512, 128, 64, 128, True)
    assert v2.router_scoring == "softmax" and v2.router_groups is None and not v2.router_score_bias
    assert not v2.norm_topk_prob and v2.shared_expert_size == 2816 and v2.num_experts_per_tok == 6
    assert v2.attention_scale_factor == pytest.approx((0.1 * 0.707 * np.log(40) + 1) ** 2)
    assert round(v2.num_params / 1e9, 1) == 15.7  # the model card: 15.7B parameters
    preset = shape_config("deepseek-v2-lite", max_len=4096)  # the benchmarks' random-weight stand-in: the same shape
    assert preset.num_params == v2.num_params and preset.mla == v2.mla and preset.moe_layers == v2.moe_layers
    assert ModelConfig.from_hf_dict(v2.to_hf_dict()) == v2
    grouped = ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE, "topk_method": "group_limited_greedy", "n_group": 8,
                                        "topk_group": 3})
    assert grouped.router_groups == (8, 3) and ModelConfig.from_hf_dict(grouped.to_hf_dict()) == grouped


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="scoring_func='softmax' is not DeepseekV3ForCausalLM's"):
        ModelConfig.from_hf_dict({**DEEPSEEK_V3, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="transformers' DeepseekV2 never renormalises"):
        ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE, "norm_topk_prob": True})
    with pytest.raises(ValueError, match="topk_method='noaux_tc': DeepSeek-V2 routes"):
        ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE, "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match="HF DeepSeek-V2 has a softmax router"):
        testing.tiny_config("deepseek_v2", norm_topk_prob=True).to_hf_dict()
    with pytest.raises(ValueError, match="needs head_dim = nope \\+ rope = 20"):
        testing.tiny_config("deepseek_v3", head_dim=16)
    with pytest.raises(ValueError, match="router_groups=\\(n_group, topk_group\\) must split"):
        testing.tiny_config("deepseek_v3", router_groups=(3, 2))
    with pytest.raises(ValueError, match="are DeepSeek's; HF qwen3_moe has none"):
        testing.tiny_config("qwen3_moe", router_scoring="sigmoid").to_hf_dict()
    with pytest.raises(ValueError, match="apply to a mixture of experts"):
        testing.tiny_config("llama", routed_scaling_factor=2.0)
    with pytest.raises(ValueError, match="ModelConfig.mla must be MLA"):
        testing.tiny_config("deepseek_v3", mla=(1, 2))


def test_router_matches_transformers():
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = testing.tiny_config("deepseek_v3", num_experts=16, num_experts_per_tok=3, router_groups=(4, 2))
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                              if k not in ("architectures", "model_type")})
    router = DeepseekV3TopkRouter(hf_cfg)
    rng = np.random.default_rng(0)
    weight, bias = rng.normal(size=(16, cfg.hidden_size)) / 8, rng.normal(size=16) * 0.3
    x = rng.normal(size=(200, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(weight)), router.e_score_correction_bias.copy_(torch.tensor(bias))
        _, want_w, want_e = (t.numpy() for t in router(torch.tensor(x)))
    logits = jnp.asarray(x) @ jnp.asarray(weight.T, jnp.float32)
    got_w, got_e = (np.asarray(t) for t in route(logits, 3, True, Scoring("sigmoid", (4, 2), 2.5),
                                                  jnp.asarray(bias, jnp.float32)))
    order_w, order_g = np.argsort(want_e, axis=1), np.argsort(got_e, axis=1)  # the same picks, in any order
    np.testing.assert_array_equal(np.take_along_axis(got_e, order_g, 1), np.take_along_axis(want_e, order_w, 1))
    np.testing.assert_allclose(np.take_along_axis(got_w, order_g, 1), np.take_along_axis(want_w, order_w, 1),
                               rtol=1e-5)
    np.testing.assert_allclose(got_w.sum(axis=1), 2.5, rtol=1e-5)
    # the groups bite: picking among all experts would choose differently for some tokens
    free = np.asarray(route(logits, 3, True, Scoring("sigmoid", None, 2.5), jnp.asarray(bias, jnp.float32))[1])
    assert (np.sort(free, 1) != np.sort(got_e, 1)).any(axis=1).mean() > 0.1


@pytest.mark.parametrize("groups", [None, (4, 2)])
def test_v2_router_matches_transformers(groups):
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = testing.tiny_config("deepseek_v2", num_experts=16, num_experts_per_tok=3, router_groups=groups)
    hf_cfg = transformers.DeepseekV2Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                              if k not in ("architectures", "model_type")})
    router = DeepseekV2TopkRouter(hf_cfg)
    rng = np.random.default_rng(1)
    weight, x = rng.normal(size=(16, cfg.hidden_size)) / 4, rng.normal(size=(200, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(weight))
        _, want_w, want_e = (t.numpy() for t in router(torch.tensor(x)))
    logits = jnp.asarray(x) @ jnp.asarray(weight.T, jnp.float32)
    got_w, got_e = (np.asarray(t) for t in route(logits, 3, False, Scoring("softmax", groups, 1.5)))
    order_w, order_g = np.argsort(want_e, axis=1), np.argsort(got_e, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(got_e, order_g, 1), np.take_along_axis(want_e, order_w, 1))
    np.testing.assert_allclose(np.take_along_axis(got_w, order_g, 1), np.take_along_axis(want_w, order_w, 1),
                               rtol=1e-5)
    assert (got_w.sum(axis=1) < 1.5).all()  # softmax probabilities, not renormalised, times 1.5


@pytest.mark.parity
@pytest.mark.parametrize("arch,q_lora_rank", [("deepseek_v3", 24), ("deepseek_v3", None), ("deepseek_v2", None)])
def test_model_matches_transformers_and_round_trips(tmp_path, arch, q_lora_rank):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config(arch, num_layers=3, mla=MLA(q_lora_rank, 16, 12, 8, 10))
    tokens = random_tokens(97, (2, 90), seed=2)  # past the YaRN original length (64)
    assert_parity_and_round_trips(tmp_path, cfg, hf_model_of(cfg, seed=1), tokens)


@pytest.mark.parametrize("arch,page_size", [("deepseek_v3", None), ("deepseek_v2", None), ("deepseek_v3", 8)])
def test_sampler_decodes_as_its_full_forward(arch, page_size):
    """The sampler caches the latent (dense cache and pages) and decodes with the key weights absorbed into the
    queries; its tokens and log-probs are those of full forwards, which expand the latent per head."""
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config(arch), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


def test_the_cache_holds_the_latent():
    from areal_jax.models.layers import dot_attention
    from areal_jax.models.mla import cache_layout, cached_values
    from areal_jax.models.paged_attention import init_paged_cache
    from areal_jax.models.rope import rope_tables
    from areal_jax.models.transformer import init_cache
    from areal_jax.system.memory import kv_position_bytes

    cfg = testing.tiny_config("deepseek_v3")
    assert cache_layout(cfg) == (1, 16 + 8, 0) and cache_layout(testing.tiny_config("qwen3")) == (2, 16, 16)
    cache = init_cache(cfg, 3, 40)  # the latent and the rotary key; no values of their own: the keys serve
    assert {x.shape for x in cache.k} == {(3, 40, 1, 24)} and {x.shape for x in cache.v} == {(3, 40, 1, 0)}
    paged = init_paged_cache(cfg, 10, 8)
    assert {x.shape for x in paged.k} == {(1, 10, 8, 24)} and {x.shape for x in paged.v} == {(1, 10, 8, 0)}
    lite = ModelConfig.from_hf_dict(DEEPSEEK_V2_LITE, dtype=jnp.bfloat16)
    item = jnp.dtype(jnp.float32).itemsize  # the CPU's cache dtype (transformer.cache_dtype)
    assert kv_position_bytes(lite, tensor=1) == 27 * (512 + 64) * item  # not 2 x 27 x 16 x 192
    # the decode's scores and outputs through the latent equal the expanded attention's, layer by layer
    model = testing.random_model(cfg, seed=4)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 7, cfg.hidden_size)), jnp.float32)
    cos, sin = rope_tables(cfg, jnp.broadcast_to(jnp.arange(7), (2, 7)))["global"]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((7, 7), bool)), (2, 7, 7))
    attn = model.layers[1].attn
    outs = []
    for cached in (False, True):
        q, k, v = attn.qkv(x, cos, sin, cached)
        outs.append(attn.out(dot_attention(q, k, cached_values(k, v), mask), cached))
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), atol=1e-5)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_fresh_prefill_attends_expanded_and_caches_the_latent(arch):
    """A prefill into an empty cache (fresh=True, the sampler's) attends in the expanded form: its hidden states equal
    the absorbed form's and the cache-free forward's, and its cache holds the same latent rows."""
    from areal_jax.models.transformer import init_cache

    cfg = testing.tiny_config(arch)
    model = testing.random_model(cfg, seed=6)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    absorbed, cache_a = model.hidden(tokens, positions, cache=init_cache(cfg, 2, 11))
    expanded, cache_e = model.hidden(tokens, positions, cache=init_cache(cfg, 2, 11), fresh=True)
    np.testing.assert_allclose(np.asarray(expanded), np.asarray(model.hidden(tokens)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(expanded), np.asarray(absorbed), atol=1e-5)
    for a, e in zip((*cache_a.k, *cache_a.v), (*cache_e.k, *cache_e.v)):
        assert a.shape == e.shape
        np.testing.assert_allclose(np.asarray(e), np.asarray(a), atol=1e-5)

    # the sampler's prefill takes that form (its prompts and recomputes start from an empty cache)
    from areal_jax.models.mla import MLAttention
    from areal_jax.sampler.prefill import prefill_rows

    seen, qkv = [], MLAttention.qkv

    def spy(self, *a, **kw):
        seen.append(a[3] if len(a) > 3 else kw.get("cached", False))
        return qkv(self, *a, **kw)

    MLAttention.qkv = spy
    try:
        cache, logits = prefill_rows(model, cfg, tokens, jnp.asarray([11, 6]))
    finally:
        MLAttention.qkv = qkv
    assert seen and set(seen) == {"fresh"}
    np.testing.assert_allclose(np.asarray(cache.k[1]), np.asarray(cache_e.k[1]), atol=1e-6)
    with pytest.raises(ValueError, match="fresh=True describes a prefill into an empty"):
        model.hidden(tokens, fresh=True)


def test_update_gradients_on_a_2x2_mesh_equal_one_devices():
    from tests.test_trainer import grads_agree_on_one_and_four_devices

    grads = grads_agree_on_one_and_four_devices(testing.tiny_config("deepseek_v3"))
    bias = [g for k, g in grads.items() if "router_score_bias" in k]
    assert len(bias) == 1 and not bias[0].any()  # the picking bias gets no gradient (so the optimizer keeps it)
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj", "shared_expert", "experts_down"):
        assert any(name in k and np.abs(g).max() > 0 for k, g in grads.items()), name


def test_head_width_192_on_accelerators():
    """Latent attention's heads are 192 wide (128 + 64): the training kernels lower for it (flash pads to a power of
    two for Triton; splash for Mosaic); the GPU paged-decode kernel takes such widths in pieces, a width that is not
    a multiple of 16 gathers, and the kernel says why when asked."""
    from jax import export

    from areal_jax.models.flash_attention import flash_attention
    from areal_jax.models.paged_attention import PagedKVCache, default_path, kernel_attention
    from areal_jax.models.splash import splash_attention

    h, t, dh = 16, 1024, 192
    shapes = [jax.ShapeDtypeStruct((1, t, h, dh), jnp.bfloat16)] * 3 + [jax.ShapeDtypeStruct((1, t), jnp.int32)]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for platform, attend, kernel in (("cuda", flash_attention, "__gpu$xla.gpu.triton"),
                                     ("tpu", splash_attention, "tpu_custom_call")):
        def loss(q, k, v, seg, attend=attend):
            return attend(q, k, v, seg, interpret=False).astype(jnp.float32).sum()

        text = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=[platform],
                             disabled_checks=checks)(*shapes).mlir_module()
        assert text.count(f"@{kernel}") >= 3 and f"{t}x{t}x" not in text, platform
    # paged decode: GPUs gather 192 (and the latent's 576) by default, reading them in power-of-two pieces
    # (models.paged_pieces) when the kernel path is asked for; TPUs gather
    assert default_path(192, "gpu") == "gather" == default_path(576, "gpu") == default_path(192, "tpu")
    assert default_path(128, "gpu") == "kernel" == default_path(128, "tpu")
    pages = jnp.zeros((h, 4, 16, 200), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16, got 200"):
        kernel_attention(jnp.zeros((2, 1, h, 200), jnp.bfloat16), PagedKVCache((pages,), (pages,)), 0,
                         jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 1), jnp.int32), platform="gpu")
