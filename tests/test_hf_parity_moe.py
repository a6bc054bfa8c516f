"""Mixtures of experts against HF transformers (PyTorch, float32): Qwen3-MoE (Qwen3MoeForCausalLM, with dense layers
between expert ones), Mixtral (MixtralForCausalLM, with a sliding window), OLMoE (OlmoeForCausalLM) and Qwen2-MoE
(Qwen2MoeForCausalLM, with its shared expert), FlexOlmo (FlexOlmoForCausalLM: OLMo 2's layer); every expert path; checkpoint round
trips through the per-expert tensors; what the real checkpoints' config.json says."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import Transformer, load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import read_safetensors_dir
from areal_jax.testing.hf import hf_logits, random_tokens, randomize_torch
from areal_jax.testing.models import tiny_config, write_random_hf_checkpoint

torch = pytest.importorskip("torch", reason="parity tests need PyTorch (pip install areal_jax[parity])")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers (areal_jax[parity])")

pytestmark = pytest.mark.parity

SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hf_model(path, arch, seed=0, **kw):
    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{**SHAPE, "num_experts": 8, "num_experts_per_tok": 3,
                                                "moe_intermediate_size": 24, "norm_topk_prob": False, **kw})
        model = transformers.Qwen3MoeForCausalLM(config)
    elif arch == "olmoe":
        config = transformers.OlmoeConfig(**{**SHAPE, "num_experts": 8, "num_experts_per_tok": 2, **kw})
        model = transformers.OlmoeForCausalLM(config)
    elif arch == "flex_olmo":
        config = transformers.FlexOlmoConfig(**{**SHAPE, "num_experts": 8, "num_experts_per_tok": 3, **kw})
        model = transformers.FlexOlmoForCausalLM(config)
    elif arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**{**SHAPE, "num_experts": 8, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                                                **kw})
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**{**SHAPE, "num_local_experts": 4, "num_experts_per_tok": 2, **kw})
        model = transformers.MixtralForCausalLM(config)
    model = randomize_torch(model.to(torch.float32).eval(), seed)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch,extra", [
    ("qwen3_moe", {"mlp_only_layers": [1]}),  # a dense MLP of intermediate_size between two expert layers
    ("qwen3_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True}),  # experts in the second layer only
    ("mixtral", {"sliding_window": 7}),
    ("olmoe", {"norm_topk_prob": False}),
    ("qwen2_moe", {"mlp_only_layers": [1]}),  # the shared expert beside the routed ones, a dense layer between
    ("flex_olmo", {"norm_topk_prob": True}),  # OLMo 2's layer (norms after attention and experts only), OLMoE's experts
])
def test_logits_match_transformers_on_every_expert_path(tmp_path, arch, extra):
    hf = _hf_model(tmp_path, arch, seed=1, **extra)
    ours = load_hf_checkpoint(tmp_path)
    cfg = ours.cfg
    assert cfg.architecture == arch and cfg.num_experts == (4 if arch == "mixtral" else 8)
    flags = [int(cfg.layer_is_moe(i)) for i in range(3)]
    assert flags == {"mlp_only_layers": [1, 0, 1], "decoder_sparse_step": [0, 1, 0]}.get(next(iter(extra)), [1, 1, 1])
    assert cfg.olmo == (arch == "flex_olmo") and cfg.flat_qk_norm == (arch in ("olmoe", "flex_olmo"))
    assert cfg.shared_expert_size == (40 if arch == "qwen2_moe" else None)
    tokens = random_tokens(cfg.vocab_size, (2, 30), seed=2)
    ref = hf_logits(hf, tokens)
    assert np.abs(ref).max() > 1.0
    for impl in ("blocked", "dense", "ragged"):
        model = Transformer(cfg.replace(moe_impl=impl), rngs=nnx.Rngs(0))
        nnx.update(model, nnx.state(ours))
        np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    # the routing has teeth: sending every token to other experts changes the logits
    router = ours.layers[flags.index(1)].mlp.router
    router.set_value(-router[...])
    assert np.abs(np.asarray(ours(jnp.asarray(tokens))) - ref).max() > 1e-2


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "flex_olmo"])
def test_hf_to_ours_to_hf_is_byte_identical_and_loads_back(tmp_path, arch):
    """Each expert's tensors are stacked on loading and split again on saving: every tensor comes back byte for
    byte (sharded files too), and transformers loads our directory with the same logits."""
    _hf_model(tmp_path / "hf", arch, seed=3, **({"mlp_only_layers": [2]} if arch.endswith("_moe") else {}))
    ours = load_hf_checkpoint(tmp_path / "hf")
    save_hf_checkpoint(ours, tmp_path / "ours", max_shard_size=40_000)
    before, after = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "ours")
    assert before.keys() == after.keys()
    assert any(".experts.3." in name for name in after) and (tmp_path / "ours" / "model.safetensors.index.json").exists()
    for name, tensor in before.items():
        assert tensor.tobytes() == after[name].tobytes(), name
    assert load_hf_checkpoint(tmp_path / "ours").cfg == ours.cfg
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = random_tokens(101, (1, 30), seed=4)
    np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(original, tokens))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "flex_olmo"])
def test_a_config_of_ours_loads_in_transformers(tmp_path, arch):
    cfg = tiny_config(arch, num_layers=3, **({"moe_layers": (0, 1, 1)} if arch.endswith("_moe") else {}))
    ours = write_random_hf_checkpoint(tmp_path, cfg, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                                 "olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                 "flex_olmo": "FlexOlmoForCausalLM"}[arch]
    tokens = random_tokens(cfg.vocab_size, (2, 30), seed=6)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_bfloat16_logits_stay_close_to_transformers(tmp_path):
    """bf16 weights and compute on both sides; routing near a tie may pick another expert in bf16, so the check is
    on most positions."""
    hf = _hf_model(tmp_path, "qwen3_moe", seed=7).to(torch.bfloat16)
    ours = load_hf_checkpoint(tmp_path, param_dtype=jnp.bfloat16)
    tokens = random_tokens(101, (2, 30), seed=8)
    got, want = np.asarray(ours(jnp.asarray(tokens)), np.float32), hf_logits(hf, tokens)
    close = np.abs(got - want).max(-1) < 0.1 * np.abs(want).max()
    assert close.mean() > 0.9


def test_moe_config_layouts():
    """What the real checkpoints' config.json says (the keys that matter), read as transformers reads them."""
    qwen = {  # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "hidden_act": "silu", "attention_bias": False, "router_aux_loss_coef": 0.001}
    cfg = ModelConfig.from_hf_dict(qwen)
    assert cfg.qk_norm and cfg.moe_layers is None and cfg.expert_size == 768 and cfg.norm_topk_prob
    assert round(cfg.num_params / 1e9, 1) == 30.5  # "30.5B in total, 3.3B activated"
    mixtral = {  # mistralai/Mixtral-8x7B-v0.1
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6,
        "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
        "router_jitter_noise": 0.0}
    cfg = ModelConfig.from_hf_dict(mixtral)
    assert cfg.norm_topk_prob and cfg.expert_size == 14336 and cfg.sliding_window is None
    assert round(cfg.num_params / 1e9, 1) == 46.7
    with pytest.raises(ValueError, match="needs num_experts"):
        ModelConfig.from_hf_dict({**mixtral, "num_local_experts": 0})
    olmoe = {  # allenai/OLMoE-1B-7B-0924
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
        "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}
    cfg = ModelConfig.from_hf_dict(olmoe)
    assert cfg.qk_norm and cfg.flat_qk_norm and not cfg.olmo and not cfg.norm_topk_prob
    assert round(cfg.num_params / 1e9, 2) == 6.92  # "1B active and 7B total parameters"
    with pytest.raises(ValueError, match="clip_qkv=8.0"):
        ModelConfig.from_hf_dict({**olmoe, "clip_qkv": 8.0})
    qwen2 = {  # Qwen/Qwen1.5-MoE-A2.7B
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
        "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "max_position_embeddings": 8192,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False,
        "hidden_act": "silu"}
    cfg = ModelConfig.from_hf_dict(qwen2)
    assert cfg.attention_bias and cfg.shared_expert_size == 5632 and cfg.expert_size == 1408
    # FlexOlmo: a config.json that leaves its keys out reads transformers' FlexOlmoConfig defaults
    flex, theirs = ModelConfig.from_hf_dict({"architectures": ["FlexOlmoForCausalLM"], "model_type": "flex_olmo"}), \
        transformers.FlexOlmoConfig()
    assert (flex.vocab_size, flex.hidden_size, flex.intermediate_size, flex.num_layers, flex.num_heads,
            flex.num_kv_heads, flex.num_experts, flex.num_experts_per_tok, flex.norm_topk_prob, flex.rope_theta,
            flex.rms_norm_eps, flex.eos_token_id) == (
        theirs.vocab_size, theirs.hidden_size, theirs.intermediate_size, theirs.num_hidden_layers,
        theirs.num_attention_heads, theirs.num_key_value_heads, theirs.num_experts, theirs.num_experts_per_tok,
        theirs.norm_topk_prob, theirs.rope_parameters["rope_theta"], theirs.rms_norm_eps, theirs.eos_token_id)
    assert flex.olmo and flex.flat_qk_norm and flex.expert_size == flex.intermediate_size
    assert round(cfg.num_params / 1e9, 1) == 14.3  # "14.3B parameters in total and 2.7B activated"
