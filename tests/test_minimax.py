"""MiniMax-M2 (MiniMaxM2ForCausalLM: M2, M2.1, M2.5): the released config read as transformers reads it, logits
against transformers' class (q/k norm over all heads, half of each head rotating, sigmoid routing with a picking bias
beside Mixtral's experts), checkpoint round trips both ways, the sampler against full forwards, and the errors that
name what transformers would run otherwise."""
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing
from areal_jax.testing.hf import hf_logits, random_tokens, randomize_torch

MINIMAX_M2 = {  # MiniMaxAI/MiniMax-M2's shape: 62 layers of 8 of 256 experts, 64 of 128 dimensions rotating
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064, "hidden_size": 3072,
    "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8,
    "head_dim": 128, "rotary_dim": 64, "num_local_experts": 256, "num_experts_per_tok": 8, "rope_theta": 5000000,
    "scoring_func": "sigmoid", "use_routing_bias": True, "tie_word_embeddings": False,
    "max_position_embeddings": 196608, "rms_norm_eps": 1e-06, "use_mtp": True, "num_mtp_modules": 3}


def test_released_config_reads_as_transformers_reads_it():
    cfg = ModelConfig.from_hf_dict(MINIMAX_M2)
    assert (cfg.architecture, cfg.rotary_dim, cfg.rope_theta, cfg.num_experts, cfg.expert_size) == (
        "minimax_m2", 64, 5e6, 256, 1536)
    assert cfg.qk_norm and cfg.flat_qk_norm and not cfg.attention_bias and cfg.moe_layers is None
    assert cfg.router_scoring == "sigmoid" and cfg.router_score_bias and cfg.norm_topk_prob
    assert cfg.router_groups is None and cfg.routed_scaling_factor == 1.0 and cfg.shared_expert_size is None
    # the model card: 230B parameters in all, 10B active
    assert 228e9 < cfg.num_params < 230e9 and 9.5e9 < cfg.matmul_params_per_token < 10e9
    for key, value, match in (("scoring_func", "softmax", "scores experts with a sigmoid"),
                              ("routed_scaling_factor", 2.0, "renormalised scores alone"),
                              ("shared_intermediate_size", 512, "no shared expert")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**MINIMAX_M2, key: value})
    with pytest.raises(ValueError, match="HF MiniMaxM2 routes by sigmoid scores"):
        testing.tiny_config("minimax_m2", norm_topk_prob=False).to_hf_dict()
    with pytest.raises(ValueError, match="HF MiniMaxM2 has q/k norm"):
        testing.tiny_config("minimax_m2", qk_norm=False).to_hf_dict()


@pytest.mark.parity
@pytest.mark.parametrize("rotary_dim", [8, None])
def test_model_matches_transformers_and_round_trips(tmp_path, rotary_dim):
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("minimax_m2", rotary_dim=rotary_dim)
    hf_cfg = transformers.MiniMaxM2Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                             if k not in ("architectures", "model_type")})
    hf = randomize_torch(transformers.MiniMaxM2ForCausalLM(hf_cfg).eval(), seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # a buffer, not a parameter: drawn here so that it changes picks
        for layer in hf.model.layers:
            layer.mlp.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.num_experts, generator=gen))
    hf.save_pretrained(tmp_path / "hf")
    tokens = random_tokens(97, (2, 40), seed=3)
    ref = hf_logits(hf, tokens)
    assert np.abs(ref).max() > 1.0
    for attention in ("dense", "blocked"):
        ours = load_hf_checkpoint(tmp_path / "hf")
        assert ours.cfg == cfg
        got = np.asarray(ours.unembed(ours.hidden(jnp.asarray(tokens), attention=attention)))
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=attention)
    bias = np.asarray(ours.layers[0].mlp.router_score_bias[...])
    np.testing.assert_array_equal(bias, hf.model.layers[0].mlp.e_score_correction_bias.numpy())
    save_hf_checkpoint(ours, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(again) is type(hf)
    np.testing.assert_array_equal(hf_logits(again, tokens), ref)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("minimax_m2"), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)
