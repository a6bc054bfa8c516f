"""dots.llm1 (Dots1ForCausalLM) against HF transformers (PyTorch, float32): Qwen3's attention (per-head q/k norms) with
sliding windows in the layers layer_types names, a dense first layer, then DeepSeek-V3's sigmoid router with its
picking bias over experts and a shared expert; logits and round trips both ways, transformers' own config class and
its default layer kinds, the sampler's decode against full forwards, the refusals, PEFT adapters on the experts."""
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config

_SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1)


@pytest.mark.parity
def test_logits_match_transformers_and_round_trip(tmp_path):
    """Three layers: full attention and a dense MLP first, then two sliding layers (window 8) with experts; the
    picking bias drawn large enough to change picks; 40 tokens, so the windows cut."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("dots1", num_layers=3)
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    bias = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))  # (a buffer there)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters()) + bias


@pytest.mark.parity
def test_its_config_class(tmp_path):
    """transformers' Dots1Config: by default no layer slides (max_window_layers 62); with max_window_layers=1 the
    layers from the second on do. Our logits and fields."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    tokens = random_tokens(97, (2, 30), seed=1)
    ours = ours_of_their_class(tmp_path / "a", transformers.Dots1ForCausalLM, transformers.Dots1Config(**_SMALL), tokens)
    assert ours.cfg.sliding_window is None and ours.cfg.qk_norm and ours.cfg.router_scoring == "sigmoid"
    assert ours.cfg.moe_layers == (0, 1, 1) and not ours.cfg.norm_topk_prob and ours.cfg.shared_expert_size == 16
    config = transformers.Dots1Config(**_SMALL, sliding_window=6, max_window_layers=1, norm_topk_prob=True,
                                      routed_scaling_factor=2.0)
    ours = ours_of_their_class(tmp_path / "b", transformers.Dots1ForCausalLM, config, tokens)
    assert ours.cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert ours.cfg.sliding_window == 6 and ours.cfg.norm_topk_prob and ours.cfg.routed_scaling_factor == 2.0


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_decodes_as_its_full_forward(page_size):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("dots1", num_layers=3), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, new_tokens=20)


def test_the_refusals_name_what_to_change():
    d = {**_SMALL, "model_type": "dots1"}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.head_dim == 16 and cfg.num_experts == 8 and cfg.layer_types is None
    with pytest.raises(ValueError, match="needs n_routed_experts and num_experts_per_tok"):
        ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "n_routed_experts"})
    with pytest.raises(ValueError, match="layer_types must name 'full_attention' or 'sliding_attention' for each"):
        ModelConfig.from_hf_dict({**d, "layer_types": ["full_attention"] * 2})
    with pytest.raises(ValueError, match="per-head q/k norms and rotates every dimension; set qk_norm=True"):
        tiny_config("dots1", qk_norm=False).to_hf_dict()
    with pytest.raises(ValueError, match="are DeepSeek's; HF qwen3_moe has none"):
        tiny_config("qwen3_moe", router_scoring="sigmoid", router_score_bias=True).to_hf_dict()


@pytest.mark.parity
def test_peft_adapters_on_attention_and_the_experts(tmp_path):
    """Adapters on q, v and the experts: peft's logits over transformers' model equal ours, and the directory reads
    back."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from areal_jax.testing.hf import assert_peft_round_trip, peft_exported
    from areal_jax.testing.models import write_random_hf_checkpoint

    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, tiny_config("dots1", num_layers=2), seed=0)
    model, lcfg, out = peft_exported(base, tmp_path / "adapter", "q,v,experts")
    assert_peft_round_trip(out, base, model, lcfg, random_tokens(97, (2, 24), seed=5))
