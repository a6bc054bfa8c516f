"""InternLM3 (model type internlm3: internlm3-8b-instruct; transformers runs it as Llama's model) against HF transformers
(PyTorch, float32): logits and round trips both ways through transformers' InternLM3Config (its LlamaForCausalLM), the
released config.json's older key names (qkv_bias, bias) and its dynamic NTK RoPE (the default frequencies up to
max_position_embeddings, longer runs refused), internlm3-8b's parameter count, the refusals."""
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, random_tokens
from areal_jax.testing.models import tiny_config

DYNAMIC = {"rope_type": "dynamic", "factor": 6.0}
RELEASED = {  # internlm3-8b-instruct's config.json, the keys that matter
    "architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3", "vocab_size": 128512, "hidden_size": 4096,
    "intermediate_size": 10240, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 2,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "rope_theta": 50000000, "rope_scaling": {"factor": 6.0, "rope_type": "dynamic"}, "qkv_bias": False, "bias": False,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _hf(cfg, transformers):
    from areal_jax.testing.hf import randomize_torch

    d = cfg.to_hf_dict()
    config = transformers.InternLM3Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    return randomize_torch(transformers.LlamaForCausalLM(config).eval(), seed=1)


@pytest.mark.parity
@pytest.mark.parametrize("rope", [None, DYNAMIC], ids=["default", "dynamic"])
def test_logits_match_transformers_and_round_trip(tmp_path, rope):
    """Within max_position_embeddings (256 here; 40 tokens) transformers' dynamic NTK RoPE is the default one."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("internlm3", num_layers=3, rope_scaling=rope)
    hf = _hf(cfg, transformers)
    assert hf.config.model_type == "internlm3"
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


def test_the_released_config_and_its_length():
    cfg = ModelConfig.from_hf_dict(RELEASED)
    assert cfg.architecture == "internlm3" and cfg.rope_scaling == DYNAMIC and not cfg.attention_bias
    assert cfg.num_params == 8_804_241_408  # embeddings and the untied output 2 x 128,512 x 4,096, 48 layers
    assert cfg.for_sequence_length(32768) is cfg
    with pytest.raises(ValueError, match="dynamic NTK scaling.*keep sequences .rollout.max_len. to 32768 tokens"):
        cfg.for_sequence_length(32769)
    bare = {k: v for k, v in RELEASED.items() if k not in ("head_dim", "num_key_value_heads", "rms_norm_eps")}
    same = ModelConfig.from_hf_dict(bare)  # (InternLM3Config's defaults: head_dim 128, 2 kv heads, 1e-5)
    assert (same.head_dim, same.num_kv_heads, same.rms_norm_eps) == (128, 2, 1e-5)
    with pytest.raises(ValueError, match="attention_bias=True for internlm3 also adds an o_proj bias"):
        ModelConfig.from_hf_dict({**RELEASED, "qkv_bias": True})
    with pytest.raises(ValueError, match="mlp_bias=True is not supported"):
        ModelConfig.from_hf_dict({**RELEASED, "bias": True})
    with pytest.raises(ValueError, match="rope_scaling of type 'dynamic' needs a positive factor"):
        tiny_config("internlm3", rope_scaling={"rope_type": "dynamic"})


def test_dynamic_rope_tables_are_the_default_ones():
    import jax.numpy as jnp

    from areal_jax.models.rope import rope_tables

    positions = jnp.arange(256)[None]
    plain, dynamic = (rope_tables(tiny_config("internlm3", rope_scaling=s), positions) for s in (None, DYNAMIC))
    for a, b in zip(plain["global"], dynamic["global"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
