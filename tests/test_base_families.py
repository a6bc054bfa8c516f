"""The families `models.base_families.BASE` describes by one row each: which layers slide as transformers' own config
classes compute them (their `layer_types`), and the refusals a row implies (q/k norms, q/k/v biases, sliding windows,
experts, RoPE bases) before a config.json is written."""
import pytest

from areal_jax.models.base_families import BASE
from areal_jax.models.config import ModelConfig
from areal_jax.testing.models import tiny_config

transformers = pytest.importorskip("transformers")

_CONFIG_CLASS = {arch: family.hf_class.replace("ForCausalLM", "Config") for arch, family in BASE.items()}
_CONFIG_CLASS.update(gemma3="Gemma3TextConfig", internlm3="InternLM3Config")  # (InternLM3: Llama's model)
_SLIDING = dict(sliding_window=64, use_sliding_window=True, max_position_embeddings=512, max_window_layers=2,
                num_hidden_layers=6)


def _kinds(cfg: ModelConfig) -> list[str]:
    return ["full_attention" if cfg.layer_window(i) is None else "sliding_attention" for i in range(cfg.num_layers)]


@pytest.mark.parametrize("arch", sorted(BASE))
@pytest.mark.parametrize("sliding", [False, True], ids=["defaults", "sliding"])
def test_layer_kinds_are_those_transformers_config_computes(arch, sliding):
    theirs = getattr(transformers, _CONFIG_CLASS[arch])(**(_SLIDING if sliding else {}))
    ours = ModelConfig.from_hf_dict(theirs.to_dict())
    assert ours.architecture == arch and ours.qk_norm == BASE[arch].qk_norm
    if getattr(theirs, "layer_types", None) is not None:  # (the classes that compute one per layer)
        assert _kinds(ours) == list(theirs.layer_types)
        if "sliding_attention" in theirs.layer_types:
            assert ours.sliding_window == theirs.sliding_window
    elif BASE[arch].windows == "none":
        assert ours.sliding_window is None  # (their classes ignore the key)
    elif sliding:  # every layer slides when the window is set (and, for Qwen3-MoE, use_sliding_window)
        assert _kinds(ours) == ["sliding_attention"] * 6 and ours.sliding_window == 64


@pytest.mark.parametrize("arch", sorted(a for a, f in BASE.items() if f.attention_bias is not None))
def test_a_row_refuses_the_norms_and_biases_its_class_lacks(arch):
    family = BASE[arch]
    base = tiny_config(arch)
    assert base.to_hf_dict()["architectures"] == [family.hf_class]
    with pytest.raises(ValueError, match=f"HF .*{'has q/k norm' if family.qk_norm else 'no q/k norm'}"):
        base.replace(qk_norm=not family.qk_norm).to_hf_dict()
    with pytest.raises(ValueError, match="q/k/v bias"):
        base.replace(attention_bias=not family.attention_bias).to_hf_dict()


@pytest.mark.parametrize("arch", sorted(a for a, f in BASE.items() if f.windows == "none"))
def test_a_row_without_windows_refuses_a_sliding_config(arch):
    with pytest.raises(ValueError, match="sliding"):  # (before: OLMoE's and MiniMax-M2's windows were dropped)
        tiny_config(arch, sliding_window=8).to_hf_dict()


@pytest.mark.parametrize("arch", sorted(a for a, f in BASE.items() if f.windows in ("every", "flagged")))
def test_a_row_sliding_every_layer_refuses_full_layers(arch):
    with pytest.raises(ValueError, match="slides every layer or none"):
        tiny_config(arch, sliding_window=8, layer_types=("sliding_attention", "full_attention")).to_hf_dict()


def test_rope_bases_of_sliding_layers_only_where_a_row_has_them():
    assert sorted(a for a, f in BASE.items() if f.local_base is not None) == ["gemma3", "olmo3"]
    with pytest.raises(ValueError, match="HF Gemma2ForCausalLM has one RoPE base for every layer"):
        tiny_config("gemma2", rope_local_theta=5000.0).to_hf_dict()
    cfg = tiny_config("olmo3", rope_local_theta=5000.0)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()).rope_local_theta == 5000.0
