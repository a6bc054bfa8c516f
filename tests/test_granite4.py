"""Granite 4.0 (GraniteMoeHybridForCausalLM: granite-4.0-micro, the hybrids with Mamba-2 layers, dense or with experts)
against HF transformers (PyTorch, float32): logits with RoPE and without, with Mamba-2 layers over several chunks,
round trips, checkpoints of transformers' own config class, parameter counts (granite-4.0-micro's config, a 3B
hybrid's), the Mamba-2 scan against its token recurrence (segments, a carried state), the sampler's decode against
full forwards, packed rows, PEFT adapters over the experts, and the refusals."""
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens
from areal_jax.testing.models import random_model, tiny_config

HYBRID = dict(num_layers=4, mamba=(4, 32, 16, 2, 4),
              layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"))
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, shared_expert_size=96,
           shared_expert_gated=False)  # Granite 3 MoE's experts beside the shared MLP (of intermediate_size)

# granite-4.0-micro's config.json, as released (its keys of interest)
MICRO = {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 2560,
         "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8, "shared_intermediate_size": 8192,
         "intermediate_size": 8192, "vocab_size": 100352, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
         "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 10.0,
         "rope_theta": 10_000_000.0, "max_position_embeddings": 131072, "layer_types": ["attention"] * 40,
         "position_embedding_type": "rope", "num_local_experts": 0, "rms_norm_eps": 1e-5, "bos_token_id": 100257,
         "eos_token_id": 100257, "pad_token_id": 100256}


@pytest.mark.parity
@pytest.mark.parametrize("rope", [True, False])
def test_logits_match_transformers_and_round_trip(tmp_path, rope):
    """transformers' class built from the config.json we write (position_embedding_type rope, and nope: no layer
    rotates): our logits, its checkpoint loads as our config, ours loads back bit-equal; the shared MLP's fused
    input_linear splits into gate and up."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("granitemoehybrid", num_layers=3, **({} if rope else {"rope_layers": (0, 0, 0)}))
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.position_embedding_type == ("rope" if rope else "nope")
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 30), seed=2))
    fused = hf.model.layers[0].shared_mlp.input_linear.weight.detach().numpy()  # [2F, D]: gate rows, then up
    f = cfg.intermediate_size
    np.testing.assert_array_equal(np.asarray(ours.layers[0].mlp.gate_proj[...]), fused[:f].T)
    np.testing.assert_array_equal(np.asarray(ours.layers[0].mlp.up_proj[...]), fused[f:].T)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_its_config_class_and_the_micro_config(tmp_path):
    """A checkpoint of transformers' GraniteMoeHybridConfig (layer types "attention", no experts, RoPE) loads with
    equal logits; granite-4.0-micro's config.json reads with transformers' parameter count (3.4B)."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import hf_logits, randomize_torch

    torch.manual_seed(0)
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        shared_intermediate_size=48, num_local_experts=0, layer_types=["attention"] * 3, position_embedding_type="rope",
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=2.0,
        max_position_embeddings=256, mamba_n_heads=4)
    hf = randomize_torch(transformers.GraniteMoeHybridForCausalLM(config).float().eval(), 0)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.cfg.intermediate_size == 48 and ours.cfg.residual_multiplier == 0.22 and ours.cfg.rope_layers is None
    tokens = random_tokens(101, (2, 24), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)

    micro = ModelConfig.from_hf_dict(MICRO)
    with torch.device("meta"):
        model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig.from_dict(MICRO))
    assert micro.num_params == sum(p.numel() for p in model.parameters())
    assert 3.3e9 < micro.num_params < 3.5e9 and micro.rope_theta == 1e7 and micro.tie_word_embeddings


@pytest.mark.parity
@pytest.mark.parametrize("experts", [False, True])
def test_mamba2_layers_match_transformers_and_round_trip(tmp_path, experts):
    """Mamba-2 layers (4 heads of 32, 2 groups of B and C of 16, 4 taps with a bias) between attention ones, with a
    dense MLP or with experts beside the shared MLP (granite-4.0-h-tiny's form): logits over 150 tokens (three chunks
    of the scan), round trips both ways, the parameter count."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("granitemoehybrid", **HYBRID, **(MOE if experts else {}))
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.layer_types[0] == "linear_attention" and hf.model.layers[0].mamba is not None
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 150), seed=2), atol=1e-5)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_the_hybrid_config_class_and_a_3b_hybrid(tmp_path):
    """A checkpoint of transformers' GraniteMoeHybridConfig with "mamba" / "attention" layer types (the mixer's head
    width from mamba_expand) loads with equal logits; a 3B-scale hybrid config (36 Mamba-2 layers, 4 of attention)
    reads with transformers' parameter count."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import hf_logits, randomize_torch

    torch.manual_seed(0)
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        shared_intermediate_size=48, num_local_experts=0, layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=1, max_position_embeddings=256)
    hf = randomize_torch(transformers.GraniteMoeHybridForCausalLM(config).float().eval(), 0)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    assert tuple(ours.cfg.mamba) == (8, 16, 16, 1, 4, "after_gate") and ours.cfg.rope_layers == (0, 0, 0)  # no RoPE by default
    tokens = random_tokens(101, (2, 40), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)
    hybrid = {**MICRO, "num_hidden_layers": 40, "hidden_size": 2048, "num_attention_heads": 32,
               "shared_intermediate_size": 8192, "mamba_n_heads": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
               "mamba_expand": 2, "position_embedding_type": "nope",
               "layer_types": ["attention" if i in (9, 18, 27, 36) else "mamba" for i in range(40)]}
    cfg = ModelConfig.from_hf_dict(hybrid)
    with torch.device("meta"):
        model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig.from_dict(hybrid))
    assert cfg.num_params == sum(p.numel() for p in model.parameters())


def test_the_scan_against_its_token_recurrence():
    """`mamba2.ssd` over packed segments (a chunk boundary inside one) and from a carried state equals `ssd_step`
    token by token."""
    import jax

    from areal_jax.models.mamba2 import ssd, ssd_step

    rng = np.random.default_rng(0)
    b, t, h, p, n = 2, 21, 3, 4, 5
    x, bb, cc = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, t, h, p), (b, t, h, n), (b, t, h, n)))
    dt = jax.nn.softplus(jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32))
    a = -jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
    seg = jnp.asarray([[1] * 13 + [2] * 8, [3] * 21], jnp.int32)
    start = jnp.asarray(rng.normal(size=(b, h, p, n)), jnp.float32)
    got, last = ssd(x, dt, a, bb, cc, seg, chunk=8)
    with_state, _ = ssd(x, dt, a, bb, cc, state=start, chunk=8)
    for i in range(b):
        s, s2, want, want2 = jnp.zeros((1, h, p, n)), start[i:i + 1], [], []
        for j in range(t):
            if j and seg[i, j] != seg[i, j - 1]:
                s = jnp.zeros_like(s)
            y, s = ssd_step(x[i:i + 1, j], dt[i:i + 1, j], a, bb[i:i + 1, j], cc[i:i + 1, j], s)
            y2, s2 = ssd_step(x[i:i + 1, j], dt[i:i + 1, j], a, bb[i:i + 1, j], cc[i:i + 1, j], s2)
            want.append(y[0])
            want2.append(y2[0])
        np.testing.assert_allclose(np.asarray(got[i]), np.stack(want), atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(with_state[i]), np.stack(want2), atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(last[i]), np.asarray(s[0]), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size,experts", [(None, False), (8, False), (8, True)])
def test_sampler_decodes_as_its_full_forward(page_size, experts):
    """The dense cache, and pages with the Mamba-2 windows and states as ring rows beside them (with experts too)."""
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("granitemoehybrid", **HYBRID, **(MOE if experts else {})), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


@pytest.mark.long  # 20-25 s in CI; Mamba-2 segments in packed rows: tests/test_models.py's bamba and nemotron_h
def test_packed_rows_equal_the_sequences_alone():
    model = random_model(tiny_config("granitemoehybrid", **HYBRID), seed=2)
    rng = np.random.default_rng(1)
    lens = [21, 70]  # the second segment starts inside the first chunk of 64 and runs past it
    seqs = [rng.integers(0, 97, n) for n in lens]
    tokens = np.concatenate(seqs + [np.zeros(5, np.int64)])[None]
    positions = np.concatenate([np.arange(n) for n in lens] + [np.arange(5)])[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)] + [np.zeros(5, np.int64)])[None]
    packed = np.asarray(model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                              jnp.asarray(segments, jnp.int32)))
    starts = np.cumsum([0] + lens)
    for i, s in enumerate(seqs):
        alone = np.asarray(model(jnp.asarray(s[None], jnp.int32)))[0]
        np.testing.assert_allclose(packed[0, starts[i]:starts[i + 1]], alone, atol=1e-5, rtol=0)


@pytest.mark.parity
def test_peft_adapters_of_a_hybrid_with_experts(tmp_path):
    """Adapters on attention and the experts of a Mamba-2 hybrid with experts, then on its shared MLP (gate and up fused
    in shared_mlp.input_linear, named like the experts' block_sparse_moe.input_linear, so targets are full paths) and
    its Mamba-2 mixers: peft applies each with our logits, and reads each back."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")
    from flax import nnx

    from areal_jax.models import load_hf_checkpoint, lora
    from areal_jax.models.peft_io import save_peft_adapter
    from areal_jax.testing.hf import assert_peft_round_trip, randomize_lora_b
    from areal_jax.testing.models import write_random_hf_checkpoint

    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, tiny_config("granitemoehybrid", **HYBRID, **MOE), seed=0)
    tokens = random_tokens(97, (2, 24), seed=5)
    for targets in ("attn,experts", "shared,in_xbc,out"):
        model = load_hf_checkpoint(base)
        lcfg = lora.LoRAConfig(rank=4, alpha=12.0, targets=targets)
        lora.apply_lora(model, lcfg, rngs=nnx.Rngs(1))
        randomize_lora_b(model, 0.2)
        out = save_peft_adapter(model, lcfg, tmp_path / targets, base_model_name_or_path=base)
        assert_peft_round_trip(out, base, model, lcfg, tokens)


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="each attention or mamba"):
        ModelConfig.from_hf_dict({**MICRO, "num_hidden_layers": 2, "layer_types": ["mamba", "conv"]})
    with pytest.raises(ValueError, match="a convolution bias and no projection biases"):
        ModelConfig.from_hf_dict({**MICRO, "layer_types": ["mamba"] * 40, "mamba_conv_bias": False})
    with pytest.raises(ValueError, match="a clamped time step is not supported"):
        ModelConfig.from_hf_dict({**MICRO, "layer_types": ["mamba"] * 40, "time_step_limit": [0.0, 0.1]})
    with pytest.raises(ValueError, match="ModelConfig.mamba makes the linear_attention layers Mamba-2's"):
        tiny_config("granitemoehybrid", mamba=(4, 32, 16, 2, 4))
    with pytest.raises(ValueError, match="experts other than Granite's"):
        tiny_config("granitemoehybrid", **HYBRID, **{**MOE, "shared_expert_size": 40}).to_hf_dict()
    with pytest.raises(ValueError, match="HF Granite 4.0 \\(attention layers only\\) has none of / other: qk_norm"):
        tiny_config("granitemoehybrid", qk_norm=True).to_hf_dict()
