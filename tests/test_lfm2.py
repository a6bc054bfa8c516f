"""LFM2, LFM2-MoE and LFM3 (Lfm2ForCausalLM, Lfm2MoeForCausalLM, Lfm3ForCausalLM) against HF transformers (PyTorch,
float32): logits and checkpoint round trips, a config.json in the released form read as transformers reads it (its
parameter counts), LFM3's defaults (per-layer-type RoPE, the proportional one, head gates),
the gated short convolution's layout and segments, the sampler's decode (dense cache, pages, a tensor axis) against
full forwards, LoRA's targets and the refusals (the memory plan: tests/test_qwen3_5.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import short_conv
from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens, randomize_lora_b
from areal_jax.testing.models import random_model, tiny_config

PROMPTS = [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]]
# LFM2-1.2B's config.json as released (its keys of the original training code: block_ff_dim, full_attn_idxs, ...)
RELEASED_1_2B = {"architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": True, "block_dim": 2048,
                 "block_ff_dim": 12288, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
                 "block_norm_eps": 1e-05, "bos_token_id": 1, "conv_L_cache": 3, "conv_bias": False, "conv_dim": 2048,
                 "eos_token_id": 7, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "hidden_size": 2048,
                 "max_position_embeddings": 128000, "model_type": "lfm2", "norm_eps": 1e-05, "num_attention_heads": 32,
                 "num_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pad_token_id": 0,
                 "rope_theta": 1000000.0, "vocab_size": 65536}
_ATTN_8B = (2, 6, 10, 14, 18, 21)
RELEASED_8B = {"model_type": "lfm2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_experts": 32,
               "num_experts_per_tok": 4, "moe_intermediate_size": 1792, "intermediate_size": 7168,
               "num_dense_layers": 2, "vocab_size": 65536,
               "layer_types": ["full_attention" if i in _ATTN_8B else "conv" for i in range(24)]}


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["lfm2", "lfm2_moe", "lfm3"])
def test_logits_match_transformers_and_round_trip(tmp_path, arch):
    """transformers' class built from the config.json we write, its weights (and LFM2-MoE's expert_bias) random: our
    logits on each attention path, its checkpoint loads as our config, ours loads back in transformers bit-equal."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config(arch, num_layers=4)
    hf = hf_model_of(cfg, seed=1)
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    # in_proj's B, C and x side by side channel by channel here; all B, then all C, then all x in transformers
    c = cfg.layer_types.index("conv")
    want = hf.model.layers[c].conv.in_proj.weight.detach().numpy()  # [3 D, D]
    got = np.asarray(ours.layers[c].linear_attn.in_proj[...])  # [D, 3 D]
    d = cfg.hidden_size
    for j in range(3):
        np.testing.assert_array_equal(got[:, j::3], want[j * d:(j + 1) * d].T)
    taps = hf.model.layers[c].conv.conv.weight.detach().numpy()  # [D, 1, K]
    np.testing.assert_array_equal(np.asarray(ours.layers[c].linear_attn.conv[...]), taps[:, 0].T)
    biases = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("expert_bias"))  # (a buffer there)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters()) + biases
    if arch == "lfm2_moe":
        assert biases and float(torch.abs(hf.model.layers[1].feed_forward.expert_bias).max()) > 0.1  # picks move


@pytest.mark.parity
def test_transformers_own_config_class_and_the_released_keys(tmp_path):
    """A checkpoint from transformers' Lfm2Config (block_ff_dim adjusted to 2/3 and rounded, attention layers by
    full_attn_idxs, tie_embedding, RoPE base by default) loads with equal logits; the released LFM2-1.2B and
    LFM2-8B-A1B config.json read as transformers reads them, with its parameter counts (1,170,340,608: the model
    card's; 8.34B with 1.56B active, embedding included: the 8B-A1B card's "8.3B, 1.5B active")."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import hf_logits, randomize_torch

    torch.manual_seed(0)
    config = transformers.Lfm2Config(vocab_size=101, hidden_size=64, block_ff_dim=120, block_multiple_of=16,
                                     block_ffn_dim_multiplier=1.5, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, full_attn_idxs=[1], max_position_embeddings=256,
                                     tie_embedding=False)
    hf = randomize_torch(transformers.Lfm2ForCausalLM(config).float().eval(), 0)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    cfg = ours.cfg
    assert cfg.intermediate_size == hf.model.layers[0].feed_forward.w1.weight.shape[0] == 128  # 80 x 1.5, up to 16s
    assert cfg.layer_types == ("conv", "full_attention", "conv", "conv") and cfg.short_conv == 3
    assert not cfg.tie_word_embeddings and cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-5
    tokens = random_tokens(101, (2, 24), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)

    for d, cls in ((RELEASED_1_2B, transformers.Lfm2ForCausalLM), (RELEASED_8B, transformers.Lfm2MoeForCausalLM)):
        cfg, theirs = ModelConfig.from_hf_dict(d), cls.config_class.from_dict(d)
        with torch.device("meta"):
            model = cls(theirs)
        assert list(cfg.layer_types) == list(theirs.layer_types) and cfg.tie_word_embeddings == theirs.tie_word_embeddings
        biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias"))
        assert cfg.num_params == sum(p.numel() for p in model.parameters()) + biases
    assert ModelConfig.from_hf_dict(RELEASED_1_2B).num_params == 1_170_340_608
    moe = ModelConfig.from_hf_dict(RELEASED_8B)
    assert moe.moe_layers[:3] == (0, 0, 1) and moe.router_scoring == "sigmoid" and moe.router_score_bias
    assert 8.3e9 < moe.num_params < 8.4e9
    assert 1.5e9 < moe.matmul_params_per_token + moe.vocab_size * moe.hidden_size < 1.6e9


@pytest.mark.parity
def test_lfm3_defaults_of_transformers_config_class(tmp_path):
    """A checkpoint of transformers' Lfm3Config with its defaults but the sizes (its layer pattern, per-layer-type
    RoPE: the global layers' proportional one turning half of each head's pairs, the sliding layers' base 10,000;
    head gates; four norms a layer) loads with equal logits past the window; each of those matters."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from flax import nnx

    from areal_jax.models import Transformer, load_hf_checkpoint
    from areal_jax.testing.hf import hf_logits, randomize_torch

    torch.manual_seed(0)
    config = transformers.Lfm3Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                                     max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = randomize_torch(transformers.Lfm3ForCausalLM(config).float().eval(), 0)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    cfg = ours.cfg
    assert cfg.layer_types == ("conv", "conv", "full_attention", "conv", "sliding_attention", "conv")
    assert (cfg.short_conv, cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (7, 5, 1e6, 1e4)
    assert cfg.rope_scaling["rope_type"] == "proportional" and cfg.rope_scaling["partial_rotary_factor"] == 0.5
    assert cfg.head_gate and cfg.sandwich_norms and cfg.tie_word_embeddings
    tokens = random_tokens(101, (2, 24), seed=1)
    want = hf_logits(hf, tokens)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), want, atol=1e-4, rtol=0)
    for change in ({"rope_scaling": None}, {"rope_local_theta": 1e6}, {"sliding_window": 50}):
        other = Transformer(cfg.replace(**change), rngs=nnx.Rngs(0))
        nnx.update(other, nnx.state(ours))
        assert np.abs(np.asarray(other(jnp.asarray(tokens))) - want).max() > 1e-3, change
    gate = ours.layers[2].attn.g_proj
    gate.set_value(-gate[...])
    assert np.abs(np.asarray(ours(jnp.asarray(tokens))) - want).max() > 1e-3
    with torch.device("meta"):
        full = transformers.Lfm3ForCausalLM(transformers.Lfm3Config())
    assert ModelConfig.from_hf_dict({"model_type": "lfm3"}).num_params == sum(p.numel() for p in full.parameters())


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["lfm2", "lfm3"])
def test_an_image_and_text_checkpoint_loads_its_text_decoder(tmp_path, arch):
    """LFM2-VL / LFM3-VL: the text decoder (model.language_model.*, the outer config's tied embeddings) loads as our
    config with transformers' text-only logits; saved text-only and written back into the image-and-text checkpoint
    (the export program's default), transformers' class gives the same logits again; PEFT adapters over it too."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import randomize_torch, rewrapped_logits

    cfg = tiny_config(arch, num_layers=4)
    text = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    if arch == "lfm2":
        cls, vision = transformers.Lfm2VlForConditionalGeneration, dict(
            model_type="siglip2_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, patch_size=4, num_patches=16)
    else:
        cls, vision = transformers.Lfm3VlForConditionalGeneration, dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            patch_size=4)
    hf = randomize_torch(cls(cls.config_class(text_config=text, vision_config=vision, projector_hidden_size=32)).eval(),
                         seed=4)
    hf.save_pretrained(tmp_path / "source")
    ours = load_hf_checkpoint(tmp_path / "source")
    assert ours.cfg == cfg  # the vision tower's tensors are left on disk
    tokens = random_tokens(97, (2, 30), seed=2)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), want, atol=1e-4, rtol=0)
    again = rewrapped_logits(ours, tmp_path / "source", tmp_path / "export", cls, tokens)
    np.testing.assert_allclose(again, want, atol=1e-4, rtol=0)
    # LoRA adapters on every projection, exported over the image-and-text base: named where transformers holds its
    # decoder (model.language_model.layers), peft applies them there with our logits
    peft = pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from flax import nnx

    from areal_jax.models import lora
    from areal_jax.models.peft_io import save_peft_adapter

    lcfg = lora.LoRAConfig(rank=4, alpha=12.0, targets="all")
    lora.apply_lora(ours, lcfg, rngs=nnx.Rngs(1))
    randomize_lora_b(ours, 0.2)
    out = save_peft_adapter(ours, lcfg, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "source"))
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(hf, out).eval()
        got = adapted(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
    adapted_ours = np.asarray(ours(jnp.asarray(tokens)))
    assert np.abs(adapted_ours - want).max() > 1e-2  # the adapters matter, so peft found every one of them
    np.testing.assert_allclose(got, adapted_ours, atol=1e-4, rtol=0)


@pytest.mark.parity
def test_lfm2_moe_router_against_transformers_own():
    """LFM2-MoE's picks (sigmoid scores plus expert_bias) and weights (renormalised with 1e-6 in the sum, scaled)
    equal transformers' router module's, given the same logits."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from transformers.models.lfm2_moe import modeling_lfm2_moe

    from areal_jax.models.routing import Scoring, route

    config = transformers.Lfm2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, routed_scaling_factor=2.5)
    router = modeling_lfm2_moe.Lfm2MoeTopKRouter(config)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(rng.normal(size=(8, 16)), dtype=torch.float32))
    x = rng.normal(size=(64, 16)).astype(np.float32) * 0.1  # small logits: the weights' sum far from 1
    bias = (0.3 * rng.normal(size=8)).astype(np.float32)
    with torch.no_grad():
        logits, want_w, want_e = router(torch.tensor(x), torch.tensor(bias))
    scoring = Scoring("sigmoid", None, 2.5, eps=1e-6)
    got_w, got_e = route(jnp.asarray(logits.numpy()), 3, True, scoring, jnp.asarray(bias))
    np.testing.assert_array_equal(np.sort(np.asarray(got_e), -1), np.sort(want_e.numpy(), -1))
    order = np.argsort(np.asarray(got_e), -1), np.argsort(want_e.numpy(), -1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got_w), order[0], -1),
                               np.take_along_axis(want_w.numpy(), order[1], -1), atol=1e-7, rtol=1e-6)
    model = random_model(tiny_config("lfm2_moe"), seed=0)
    assert model.layers[1].mlp.scoring.eps == 1e-6  # the model routes so


def test_short_convolution_against_its_formula():
    """The conv layer by hand (numpy): y = out(C * conv(B * x)), each tap reading its own segment only; then the
    cache path continuing from a window, token by token, gives the same outputs."""
    from flax import nnx

    from areal_jax.models.gated_deltanet import Segments, StateCache

    cfg = tiny_config("lfm2", short_conv=4)
    layer = short_conv.ShortConv(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 9, cfg.hidden_size)).astype(np.float32)
    seg = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 0]])
    w_in, taps, w_out = (np.asarray(p[...]) for p in (layer.in_proj, layer.conv, layer.out_proj))
    parts = (x @ w_in).reshape(1, 9, cfg.hidden_size, 3)
    bx, c = parts[..., 0] * parts[..., 2], parts[..., 1]
    conv = np.zeros_like(bx)
    for t in range(9):
        for back in range(4):
            if t - back >= 0 and seg[0, t - back] == seg[0, t]:
                conv[:, t] += bx[:, t - back] * taps[3 - back]
    want = (c * conv) @ w_out
    got = np.asarray(layer(jnp.asarray(x), Segments(jnp.asarray(seg))))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    held = {}
    window, state = short_conv.state_buffers(cfg, 1)
    assert state.size == 0 and short_conv.state_bytes(cfg) == window.nbytes
    outs = []
    for t in range(5):  # the first segment, one token at a time from an empty window
        ctx = StateCache(window, state, jnp.ones((1, 1), bool), lambda w, s: held.update(w=w, s=s))
        outs.append(np.asarray(layer(jnp.asarray(x[:, t:t + 1]), ctx))[:, 0])
        window = held["w"]
    np.testing.assert_allclose(np.stack(outs, 1), want[:, :5], atol=1e-5, rtol=1e-5)
    # a padding token (not valid) leaves the window as it was
    ctx = StateCache(window, state, jnp.zeros((1, 1), bool), lambda w, s: held.update(w=w, s=s))
    layer(jnp.asarray(x[:, 5:6]), ctx)
    np.testing.assert_array_equal(np.asarray(held["w"]), np.asarray(window))


@pytest.mark.parametrize("arch,page_size", [("lfm2", None), ("lfm2", 8), ("lfm2_moe", 8), ("lfm3", None), ("lfm3", 8)])
def test_sampler_decodes_as_its_full_forward(arch, page_size):
    """The dense cache, and pages with the conv windows (and LFM3's sliding layers) as ring rows beside them: three
    prompts through two slots."""
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config(arch, num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, PROMPTS, page_size=page_size)


def test_sampler_on_a_tensor_axis_splits_the_convolution_by_channels():
    """Rollout tensor parallelism: in_proj (its parts side by side per channel), the taps and out_proj split by
    channels, the windows over the same axis; greedy decoding over pages as by full forwards."""
    from jax.sharding import Mesh, PartitionSpec

    from areal_jax.models import shard_params
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tensor"))
    model = random_model(tiny_config("lfm2", num_layers=4), seed=3)
    placed = shard_params(random_model(model.cfg, seed=3), mesh).layers[0].linear_attn
    assert placed.in_proj[...].sharding.spec == PartitionSpec(None, "tensor")
    assert placed.conv[...].sharding.spec == PartitionSpec(None, "tensor")
    assert placed.out_proj[...].sharding.spec == PartitionSpec("tensor", None)
    assert_greedy_decode_is_full_forward(model, PROMPTS, page_size=8, mesh=mesh)


def test_lora_targets_the_conv_layers_by_their_own_names():
    from flax import nnx

    from areal_jax.models import lora

    cfg = tiny_config("lfm2", num_layers=4)
    lcfg = lora.LoRAConfig(rank=2, targets="all")
    paths = lora.model_targets(cfg, lcfg)
    assert {s for i, s in paths if i == 0} == {"in", "out", "gate", "up", "down"}
    assert {s for i, s in paths if i == 1} == {"q", "k", "v", "o", "gate", "up", "down"}
    assert lora.model_targets(cfg, lora.LoRAConfig(targets="in_proj")) == [(0, "in"), (2, "in"), (3, "in")]
    model = random_model(cfg, seed=0)
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(1))
    assert isinstance(model.layers[0].linear_attn.in_proj, lora.LoRAProjection)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert lora.adapter_bytes(cfg, lcfg) == 4 * n
    with pytest.raises(ValueError, match="in_qkv, which this model's stateful layers do not have; theirs are in, out"):
        lora.model_targets(cfg, lora.LoRAConfig(targets="in_qkv"))
    with pytest.raises(ValueError, match="Gated DeltaNet or LFM2 conv layers, which this model does not have"):
        lora.model_targets(tiny_config("qwen3"), lora.LoRAConfig(targets="in"))
    with pytest.raises(ValueError, match="in, which this model's stateful layers do not have"):
        lora.model_targets(tiny_config("qwen3_5_text", num_layers=4), lora.LoRAConfig(targets="in"))


def test_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="conv layers but short_conv is None"):
        tiny_config("lfm2", short_conv=None)
    with pytest.raises(ValueError, match="short_conv is set but no layer is conv"):
        tiny_config("lfm2", layer_types=None)
    with pytest.raises(ValueError, match="short_conv must be an integer >= 2"):
        tiny_config("lfm2", short_conv=1)
    with pytest.raises(ValueError, match="short_conv and linear are both set"):
        tiny_config("lfm2", linear=(2, 4, 8, 12, 4), layer_types=("linear_attention", "conv"))
    with pytest.raises(ValueError, match="head_gate .* is not supported with latent attention or Qwen3.5"):
        tiny_config("qwen3_5_text", head_gate=True)
    with pytest.raises(ValueError, match="head_gate \\(a per-head output gate, g_proj\\) is LFM3's"):
        tiny_config("qwen3", head_gate=True, qk_norm=True).to_hf_dict()
    with pytest.raises(ValueError, match="use_sandwich_norm=False is not supported"):
        ModelConfig.from_hf_dict({"model_type": "lfm3", "use_sandwich_norm": False})
    with pytest.raises(ValueError, match="conv_bias=True"):
        ModelConfig.from_hf_dict({**RELEASED_1_2B, "conv_bias": True})
    with pytest.raises(ValueError, match="each full_attention or conv"):
        ModelConfig.from_hf_dict({**RELEASED_1_2B, "layer_types": ["sliding_attention"] * 16})
    with pytest.raises(ValueError, match="short_conv \\(conv layers\\) is LFM2's and LFM3's"):
        tiny_config("qwen3", short_conv=3, layer_types=("conv", "full_attention")).to_hf_dict()
    with pytest.raises(ValueError, match="HF LFM2-MoE has dense layers first, then experts in every layer"):
        tiny_config("lfm2_moe", moe_layers=(1, 0)).to_hf_dict()
    with pytest.raises(ValueError, match="HF LFM2 has attention with a per-head q/k norm"):
        tiny_config("lfm2", qk_norm=False).to_hf_dict()
