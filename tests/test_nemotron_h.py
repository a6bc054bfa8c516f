"""Nemotron-H (NemotronHForCausalLM) against HF transformers (PyTorch, float32): logits and round trips with Mamba-2,
attention, MLP and experts blocks (a mixer followed by another: a layer without a feed-forward), transformers' own
config class from a block pattern string and the older key names, released-size configs' parameter counts, the
sampler's decode against full forwards, LoRA's targets, the Mamba-2 mixers over a tensor axis, the refusals."""
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens, randomize_lora_b
from areal_jax.testing.models import random_model, tiny_config

# NVIDIA-Nemotron-Nano-9B-v2's shape: 56 blocks (27 Mamba-2, 4 attention, 25 MLP; four Mamba-2 blocks followed by
# another mixer), as its config.json writes it (the older keys)
NANO = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 131072,
        "hidden_size": 4480, "intermediate_size": 15680, "num_hidden_layers": 56, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 80, "ssm_state_size": 128,
        "n_groups": 8, "conv_kernel": 4, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "use_conv_bias": True,
        "use_bias": False, "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 131072,
        "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"}
# NVIDIA-Nemotron-3-Nano-30B-A3B's shape: 52 blocks (23 Mamba-2, 6 attention, 23 of 128 experts, 6 a token, and a
# shared expert); its card: 31.6B parameters, 3.2B active (3.6B with the embeddings)
NANO3 = {"model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688, "intermediate_size": 1856,
         "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64,
         "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "n_routed_experts": 128, "num_experts_per_tok": 6,
         "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1,
         "routed_scaling_factor": 2.5, "norm_topk_prob": True, "tie_word_embeddings": False,
         "max_position_embeddings": 262144, "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"}
# experts in two layers of five (one of them attention's), a dense MLP in another, two layers with no feed-forward:
# blocks M * E M - M M E; 2 of 4 ungated experts by sigmoid scores with a picking bias in 2 groups (1 kept), x 2.5
EXPERTS = dict(num_layers=5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_size=40,
               shared_expert_gated=False, router_scoring="sigmoid", router_score_bias=True, norm_topk_prob=True,
               routed_scaling_factor=2.5, router_groups=(2, 1), moe_layers=(0, 1, 0, 0, 1))


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
def test_experts_blocks_match_transformers_and_round_trip(tmp_path):
    """Nemotron 3's experts blocks (ungated relu^2 experts, DeepSeek-V3's router, an ungated shared expert) beside
    dense MLP blocks; transformers holds the picking bias as a buffer, not a parameter."""
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = tiny_config("nemotron_h", **EXPERTS)
    hf = hf_model_of(cfg, seed=1)
    assert hf.config.hybrid_override_pattern == "M*EM-MME"
    assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 40), seed=2))
    biases = sum(b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
    assert biases == 8 and cfg.num_params == sum(p.numel() for p in hf.parameters()) + biases


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
    assert ours.cfg.mlp_layers == (0, 1, 0, 1, 0) and tuple(ours.cfg.mamba) == (8, 16, 16, 4, 3, "after_gate")
    tokens = random_tokens(101, (2, 40), seed=1)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)

    nano = ModelConfig.from_hf_dict(NANO)
    assert nano.num_layers == 31 and sum(nano.mlp_layers) == 25
    with torch.device("meta"):
        big = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{
            k: v for k, v in NANO.items() if k not in ("model_type", "architectures")}))
    assert nano.num_params == sum(p.numel() for p in big.parameters())  # 8.89B
    nano3 = ModelConfig.from_hf_dict(NANO3)
    assert nano3.num_layers == 29 and sum(nano3.layer_is_moe(i) for i in range(29)) == 23
    with torch.device("meta"):
        big = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{
            k: v for k, v in NANO3.items() if k != "model_type"}))
    assert nano3.num_params == sum(p.numel() for p in big.parameters()) + sum(
        b.numel() for name, b in big.named_buffers() if name.endswith("e_score_correction_bias"))
    assert round(nano3.num_params / 1e9, 1) == 31.6  # its card's; active: the card's 3.2B, unembedding included
    assert round((nano3.matmul_params_per_token + nano3.hidden_size * nano3.vocab_size) / 1e9, 1) == 3.2


@pytest.mark.parametrize("page_size,experts", [(None, False), (8, False), (8, True)])
def test_sampler_decodes_as_its_full_forward(page_size, experts):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = random_model(tiny_config("nemotron_h", **(EXPERTS if experts else {"num_layers": 4})), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


def test_lora_skips_the_layers_without_a_feed_forward():
    cfg = tiny_config("nemotron_h", num_layers=4)
    paths = lora.model_targets(cfg, lora.LoRAConfig(targets="mlp,out"))
    assert paths == [(0, "out"), (1, "up"), (1, "down"), (2, "up"), (2, "down"), (2, "out"), (3, "out")]
    assert "gate" not in {s for _, s in lora.model_targets(cfg, lora.LoRAConfig(targets="all"))}


@pytest.mark.long  # 18 s in CI; the ungated experts' paths: tests/test_moe.py, their PEFT adapters' logits: below
def test_lora_on_the_ungated_experts_and_the_merged_weights():
    """Adapters on the experts (up, down: no gate) and the shared expert: the merged model's logits equal the adapted
    model's, and the adapters' bytes are counted as held."""
    import jax
    from flax import nnx

    cfg = tiny_config("nemotron_h", **EXPERTS)
    lcfg = lora.LoRAConfig(rank=2, targets="experts,shared,q")
    assert {s for _, s in lora.model_targets(cfg, lcfg)} == {"experts_up", "experts_down", "shared_up", "shared_down",
                                                               "q"}
    model = random_model(cfg, seed=0)
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(1))
    randomize_lora_b(model, 0.3, offset=0)
    tokens = jnp.asarray(random_tokens(97, (2, 12), seed=4))
    adapted = np.asarray(model(tokens))
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert lora.adapter_bytes(cfg, lcfg) == held
    merged = lora.merged_model(model, lcfg.scale)
    assert np.abs(adapted - np.asarray(random_model(cfg, seed=0)(tokens))).max() > 1e-3
    np.testing.assert_allclose(np.asarray(merged(tokens)), adapted, atol=1e-5, rtol=0)


def test_the_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="latent projection"):
        ModelConfig.from_hf_dict({**NANO3, "moe_latent_size": 1024})
    with pytest.raises(ValueError, match="block 2 \\(mlp\\) follows no mixer"):
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


@pytest.mark.parity
def test_peft_applies_our_expert_adapters(tmp_path):
    """Adapters on attention, the Mamba-2 mixers' in_proj parts, the ungated experts (transformers' stacked up_proj /
    down_proj of the experts block after each layer's mixer block) and the shared expert: peft applies them with our
    logits, and they read back."""
    pytest.importorskip("peft", reason="the PEFT round trip needs peft")

    from areal_jax.testing.hf import assert_peft_round_trip, peft_exported
    from areal_jax.testing.models import write_random_hf_checkpoint

    base = str(tmp_path / "base")
    write_random_hf_checkpoint(base, tiny_config("nemotron_h", **EXPERTS), seed=0)
    model, lcfg, out = peft_exported(base, tmp_path / "adapter", "q,in_z,in_xbc,experts,shared")
    assert_peft_round_trip(out, base, model, lcfg, random_tokens(97, (2, 24), seed=5))


@pytest.mark.parametrize("groups", [2, 1])
def test_mamba_mixers_split_over_a_tensor_axis(groups):
    """On a (fsdp 1, tensor 2) mesh the Mamba-2 mixers split by heads (z, dt, out_proj, the norm) and, with several
    groups, x B C by whole groups (one group: held whole); the sampler's greedy decode over pages equals full forwards."""
    import jax
    from jax.sharding import Mesh, PartitionSpec

    from areal_jax.models import shard_params
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tensor"))
    model = random_model(tiny_config("nemotron_h", num_layers=4, mamba=(4, 32, 16, groups, 4)), seed=3)
    placed = shard_params(random_model(model.cfg, seed=3), mesh).layers[0].linear_attn
    split = PartitionSpec(None, "tensor")
    assert placed.in_proj_z[...].sharding.spec == split and placed.out_proj[...].sharding.spec == PartitionSpec("tensor", None)
    assert placed.norm_scale[...].sharding.spec == PartitionSpec("tensor")
    assert placed.in_proj_xbc[...].sharding.spec == (split if groups > 1 else PartitionSpec(None, None))
    assert placed.conv[...].sharding.spec == (split if groups > 1 else PartitionSpec(None, None))
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=8, mesh=mesh)


@pytest.mark.long  # 37 s; in CI the sampler's tensor-axis test above covers the split mixers' decoding
@pytest.mark.parametrize("experts", [False, True])
def test_sharded_forward_and_gradients_match_one_device(experts):
    """On a 2 x 2 (fsdp, tensor) mesh, Mamba-2 mixers of two groups split by heads and groups (and with experts, the
    ungated experts over fsdp by expert parallelism): the cache-free forward over packed rows, its gradients and the
    cache path as on one device."""
    import jax

    from areal_jax.testing.models import assert_sharded_forward_matches_one_device

    assert_sharded_forward_matches_one_device(
        tiny_config("nemotron_h", **(EXPERTS if experts else {"num_layers": 4})), jax.make_mesh((2, 2), ("fsdp", "tensor")),
        lambda model: model.layers[0].linear_attn.in_proj_xbc)
