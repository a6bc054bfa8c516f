"""Mamba (MambaForCausalLM), Falcon-Mamba (FalconMambaForCausalLM) and Mamba-2 (Mamba2ForCausalLM) against HF
transformers (PyTorch, float32): Mamba or Mamba-2 mixers alone in every layer (Falcon-Mamba's with unscaled norms of the
time step's input, B and C); logits and round trips both ways, transformers' own config classes, Mamba-Codestral-7B's
parameter count, the sampler's decode of a model with no attention layer (dense
cache, pages) against full forwards, LoRA through PEFT, the refusals; the float32 residual stream (residual_in_fp32)
in bfloat16 compute against transformers' own."""
import pytest

from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "mamba2"])
def test_logits_match_transformers_and_round_trip(tmp_path, arch):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config(arch, num_layers=3)
    hf = hf_model_of(cfg, seed=1)
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 90), seed=2))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "mamba2"])
def test_its_config_class(tmp_path, arch):
    """transformers' MambaConfig / FalconMambaConfig (the time step's rank "auto": ceil(hidden_size / 16); tied
    embeddings; Falcon-Mamba's mixer_rms_eps): our logits."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.testing.hf import ours_of_their_class

    kind = {"mamba": (transformers.MambaConfig, transformers.MambaForCausalLM),
            "falcon_mamba": (transformers.FalconMambaConfig, transformers.FalconMambaForCausalLM),
            "mamba2": (transformers.Mamba2Config, transformers.Mamba2ForCausalLM)}[arch]
    heads = dict(num_heads=4, head_dim=32, n_groups=2) if arch == "mamba2" else {}
    config = kind[0](vocab_size=101, hidden_size=64, num_hidden_layers=2, state_size=8, **heads)
    ours = ours_of_their_class(tmp_path, kind[1], config, random_tokens(101, (2, 40), seed=1))
    if arch == "mamba2":  # (num_heads x head_dim = expand x hidden_size; untied by default; its norm after the gate)
        assert ours.cfg.mamba == (4, 32, 8, 2, 4, "after_gate") and not ours.cfg.tie_word_embeddings
        return
    assert ours.cfg.mamba1[:4] == (128, 8, 4, 4) and ours.cfg.tie_word_embeddings
    assert ours.cfg.mamba1.norms == ("plain" if arch == "falcon_mamba" else None)


@pytest.mark.parametrize("arch,page_size", [("mamba", None), ("falcon_mamba", 8), ("mamba2", 8)])
def test_sampler_decodes_a_model_without_attention_as_its_full_forward(arch, page_size):
    """No layer attends: every cache entry is a window and a state per slot (pages hold nothing)."""
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config(arch, num_layers=3), seed=3)
    assert not any(model.layers[i].attn for i in range(3))
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


@pytest.mark.parity
def test_peft_adapters_of_the_mixers(tmp_path):
    """Adapters on the mixers' in_proj parts x and z: peft applies them (in_proj one module, the two parts' adapters
    side by side) with our logits, and they read back; out_proj's, which peft refuses in this model type, are refused
    by name before anything is written."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from flax import nnx

    from areal_jax.models import load_hf_checkpoint
    from areal_jax.models.peft_io import save_peft_adapter
    from areal_jax.testing.hf import assert_peft_round_trip, peft_exported
    from areal_jax.testing.models import write_random_hf_checkpoint

    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, tiny_config("falcon_mamba", num_layers=2), seed=0)
    model = load_hf_checkpoint(base)
    every = lora.LoRAConfig(rank=2, alpha=6.0, targets="all")
    assert {s for _, s in lora.model_targets(model.cfg, every)} == {"in_x", "in_z", "out"}
    lora.apply_lora(model, every, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="leave 'out' out of lora.targets"):
        save_peft_adapter(model, every, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    model, lcfg, out = peft_exported(base, tmp_path / "adapter", "in_x,in_z")
    assert_peft_round_trip(out, base, model, lcfg, random_tokens(97, (2, 24), seed=5))


def test_the_refusals_name_what_to_change():
    d = {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 97}
    assert ModelConfig.from_hf_dict(d).mamba1 == (128, 16, 4, 4, None, None)
    with pytest.raises(ValueError, match="no projection biases"):
        ModelConfig.from_hf_dict({**d, "use_bias": True})
    with pytest.raises(ValueError, match="no norms of the time step's input"):
        tiny_config("mamba", mamba1=(128, 8, 4, 4, "plain", 1e-5)).to_hf_dict()
    with pytest.raises(ValueError, match="Mamba mixers alone in every layer"):
        tiny_config("mamba", num_layers=2, mlp_layers=(1, 0), residual_in_fp32=False).to_hf_dict()
    d2 = {**d, "model_type": "mamba2", "num_heads": 4, "head_dim": 32, "n_groups": 2}
    with pytest.raises(ValueError, match=r"num_heads x head_dim \(4 x 16\) must equal expand x hidden_size"):
        ModelConfig.from_hf_dict({**d2, "head_dim": 16})
    with pytest.raises(ValueError, match="a clamped time step is not supported"):
        ModelConfig.from_hf_dict({**d2, "time_step_limit": [0.0, 0.1]})
    with pytest.raises(ValueError, match="normalised after the gate"):
        tiny_config("mamba2", mamba=(4, 32, 16, 2, 4, "before_gate")).to_hf_dict()
    assert ModelConfig.from_hf_dict(d).residual_in_fp32  # (transformers' default, the released checkpoints')
    assert not ModelConfig.from_hf_dict({**d, "residual_in_fp32": False}).residual_in_fp32
    with pytest.raises(ValueError, match="residual_in_fp32=True is supported for layers without a feed-forward"):
        tiny_config("llama", residual_in_fp32=True)
    with pytest.raises(ValueError, match="residual_in_fp32 .* is Mamba's"):
        tiny_config("nemotron_h", num_layers=1, layer_types=("linear_attention",), mlp_layers=(0,),
                    residual_in_fp32=True).to_hf_dict()


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "mamba2"])
def test_the_float32_residual_stream_in_bfloat16_compute(tmp_path, arch):
    """bf16 weights and compute, each mixer's output small beside the stream (out_proj times 0.005, so a bf16 stream
    rounds much of it away): with residual_in_fp32 our logits are nearer transformers' (bf16, residual_in_fp32 on)
    and the float32 model's than with the stream in bf16, as transformers' are with it on than off; float32 compute is
    unchanged by it (the parity test)."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import hf_logits

    hf = hf_model_of(tiny_config(arch, num_layers=6), seed=1)
    with torch.no_grad():
        for layer in hf.backbone.layers:
            layer.mixer.out_proj.weight.mul_(0.005)
    hf.save_pretrained(tmp_path)
    tokens = random_tokens(97, (2, 64), seed=2)
    exact = hf_logits(hf, tokens)
    hf = hf.to(torch.bfloat16)
    theirs = hf_logits(hf, tokens).astype(np.float32)
    for layer in hf.backbone.layers:
        layer.residual_in_fp32 = False
    theirs_bf16_stream = hf_logits(hf, tokens).astype(np.float32)
    ours = load_hf_checkpoint(tmp_path, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    assert ours.cfg.residual_in_fp32 and ours.embed(jnp.asarray(tokens)).dtype == jnp.float32
    bf16_stream = type(ours)(ours.cfg.replace(residual_in_fp32=False), rngs=nnx.Rngs(0))
    nnx.update(bf16_stream, nnx.state(ours))
    got, got_bf16_stream = (np.asarray(m(jnp.asarray(tokens)), np.float32) for m in (ours, bf16_stream))

    def gap(a, b):
        return float(np.abs(a - b).mean())

    assert gap(theirs, exact) < 0.85 * gap(theirs_bf16_stream, exact)  # (the mechanism, in transformers)
    assert gap(got, theirs) < 0.8 * gap(got_bf16_stream, theirs)
    assert gap(got, exact) < 0.85 * gap(got_bf16_stream, exact)


def test_mamba_codestral_7b_parameter_count():
    """Mamba-Codestral-7B's config.json (128 heads of 64, 8 groups of 128 states, 64 layers, untied): 7,285,403,648
    parameters, as its model card gives."""
    cfg = ModelConfig.from_hf_dict({"model_type": "mamba2", "hidden_size": 4096, "num_heads": 128, "head_dim": 64,
                                    "n_groups": 8, "state_size": 128, "num_hidden_layers": 64, "vocab_size": 32768,
                                    "expand": 2, "tie_word_embeddings": False, "time_step_limit": [0.0, float("inf")]})
    assert cfg.num_params == 7_285_403_648 and cfg.mamba.norm == "after_gate" and cfg.rms_norm_eps == 1e-5
