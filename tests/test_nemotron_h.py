"""Nemotron-H (NemotronHForCausalLM) against HF transformers (PyTorch, float32): logits and round trips with Mamba-2,
attention and MLP blocks (a mixer followed by another: a layer without a feed-forward), transformers' own config class
from a block pattern string and the older key names, a released-size config's parameter count, the sampler's decode
against full forwards, LoRA's targets, the refusals."""
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config

# NVIDIA-Nemotron-Nano-9B-v2's shape: 56 blocks (27 Mamba-2, 4 attention, 25 MLP; four Mamba-2 blocks followed by
# another mixer), as its config.json writes it (the older keys)
NANO = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 131072,
        "hidden_size": 4480, "intermediate_size": 15680, "num_hidden_layers": 56, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 80, "ssm_state_size": 128,
        "n_groups": 8, "conv_kernel": 4, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "use_conv_bias": True,
        "use_bias": False, "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 131072,
        "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"}


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("nemotron_h", num_layers=4)
    assert cfg.mlp_layers == (0, 1, 1, 0)
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.layers_block_type == ["linear_attention", "full_attention", "mlp", "linear_attention", "mlp",
                                           "linear_attention"]
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 80), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class_and_a_released_shape(tmp_path):
    """transformers' NemotronHConfig from a pattern string with the older key names (mamba_n_groups, mamba_d_conv):
    our logits; NVIDIA-Nemotron-Nano-9B-v2's config.json: our parameter count is transformers' (built without
    memory)."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import hf_logits, randomize_torch

    torch.manual_seed(0)
    config = transformers.NemotronHConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, hybrid_override_pattern="M*-MM-*", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, mamba_n_groups=4,
        mamba_d_conv=3, max_position_embeddings=256)
    hf = randomize_torch(transformers.NemotronHForCausalLM(config).float().eval(), 0)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention",
                                    "full_attention")
    assert ours.cfg.mlp_layers == (0, 1, 0, 1, 0) and tuple(ours.cfg.mamba) == (8, 16, 16, 4, 3)
    tokens = random_tokens(101, (2, 40), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)

    nano = ModelConfig.from_hf_dict(NANO)
    assert nano.num_layers == 31 and sum(nano.mlp_layers) == 25
    with torch.device("meta"):
        big = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{
            k: v for k, v in NANO.items() if k not in ("model_type", "architectures")}))
    assert nano.num_params == sum(p.numel() for p in big.parameters())


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("nemotron_h", num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


def test_lora_skips_the_layers_without_a_feed_forward():
    cfg = tiny_config("nemotron_h", num_layers=4)
    paths = lora.model_targets(cfg, lora.LoRAConfig(targets="mlp,out"))
    assert paths == [(0, "out"), (1, "up"), (1, "down"), (2, "up"), (2, "down"), (2, "out"), (3, "out")]
    assert "gate" not in {s for _, s in lora.model_targets(cfg, lora.LoRAConfig(targets="all"))}


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="blocks of experts"):
        ModelConfig.from_hf_dict({**NANO, "hybrid_override_pattern": "M-E*-"})
    with pytest.raises(ValueError, match="an MLP that follows no mixer"):
        ModelConfig.from_hf_dict({**NANO, "hybrid_override_pattern": "M--*-"})
    with pytest.raises(ValueError, match="clamped time step"):
        ModelConfig.from_hf_dict({**NANO, "time_step_limit": [0.0, 0.1]})
    with pytest.raises(ValueError, match="mlp_hidden_act='silu'"):
        ModelConfig.from_hf_dict({**NANO, "mlp_hidden_act": "silu"})
    with pytest.raises(ValueError, match="mlp_layers \\(layers without a feed-forward\\) is Nemotron-H's"):
        tiny_config("qwen3", mlp_layers=(1, 0)).to_hf_dict()
    with pytest.raises(ValueError, match="HF Nemotron-H has attention without position embeddings"):
        tiny_config("nemotron_h", rope_layers=None).to_hf_dict()


def test_peft_export_refuses_what_peft_refuses(tmp_path):
    """peft will not adapt a Mamba-2 mixer's out_proj in a nemotron_h model: the export says so before writing."""
    from flax import nnx

    from areal_jax.models.peft_io import save_peft_adapter

    model = random_model(tiny_config("nemotron_h"), seed=0)
    lcfg = lora.LoRAConfig(rank=2, targets="all")
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="leave 'out' out of lora.targets"):
        save_peft_adapter(model, lcfg, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
