"""Qwen3-Next (Qwen3NextForCausalLM: Qwen3-Next-80B-A3B): Qwen3.5-MoE's layers with q, k, v, z fused in one
in_proj_qkvz and b, a in one in_proj_ba, key head by key head, and dense MLP layers where mlp_only_layers says. Its
logits, round trips and sampler run with Qwen3.5's tests (tests/test_qwen3_5.py); here the config, where each fused
row lands, and the PEFT export's refusal of the fused projections."""
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.testing import models as testing


def test_config_of_the_released_shape_and_its_round_trip():
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen3_next"})  # transformers' Qwen3NextConfig defaults
    assert (cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size) == (48, 512, 10, 512)
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",) and cfg.rotary_dim == 64
    assert cfg.shared_expert_gated and cfg.norm_topk_prob and cfg.moe_layers is None and cfg.norm_offset
    assert 79e9 < cfg.num_params < 82e9  # the 80B of its name
    dense_first = ModelConfig.from_hf_dict({"model_type": "qwen3_next", "num_hidden_layers": 4, "mlp_only_layers": [0],
                                            "intermediate_size": 96})
    assert dense_first.moe_layers == (0, 1, 1, 1) and dense_first.intermediate_size == 96
    again = ModelConfig.from_hf_dict(dense_first.to_hf_dict())
    assert again == dense_first and dense_first.to_hf_dict()["architectures"] == ["Qwen3NextForCausalLM"]


@pytest.mark.parity
def test_fused_rows_land_in_our_projections(tmp_path):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.testing.hf import hf_model_of

    cfg = testing.tiny_config("qwen3_next", num_layers=4)
    hf = hf_model_of(cfg, seed=3)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    hf.save_pretrained(tmp_path)
    from areal_jax.models import hf_io

    reads: list[str] = []  # every whole tensor the loader reads from the files
    handle = hf_io._Reader._handle

    def counted(reader, name):
        opened = handle(reader, name)

        class Counting:
            def get_tensor(self, key):
                reads.append(key)
                return opened.get_tensor(key)

            def __getattr__(self, attr):
                return getattr(opened, attr)

        return Counting()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_io._Reader, "_handle", counted)
        ours = load_hf_checkpoint(tmp_path).layers[0].linear_attn
    fused = [n for n in reads if "in_proj_qkvz" in n or "in_proj_ba" in n]
    assert len(fused) == len(set(fused)) == 2 * 3  # each fused tensor read once (3 Gated DeltaNet layers of 4)
    theirs = hf.model.layers[0].linear_attn
    m, r = cfg.linear, cfg.linear.value_heads // cfg.linear.key_heads
    qkvz = theirs.in_proj_qkvz.weight.detach().numpy()  # [key heads x (q, k, r values, r gates), D]
    ba = theirs.in_proj_ba.weight.detach().numpy()  # [key heads x (r b, r a), D]
    block, qkv = 2 * m.key_dim + 2 * r * m.value_dim, 2 * m.key_dim + r * m.value_dim
    for g in range(m.key_heads):  # key head g: our in_qkv's g-th group and in_z's value heads g r .. g r + r - 1
        np.testing.assert_array_equal(np.asarray(ours.in_proj_qkv[...])[:, g * qkv:(g + 1) * qkv].T,
                                      qkvz[g * block:g * block + qkv])
        z = slice(g * r * m.value_dim, (g + 1) * r * m.value_dim)
        np.testing.assert_array_equal(np.asarray(ours.in_proj_z[...])[:, z].T, qkvz[g * block + qkv:(g + 1) * block])
        np.testing.assert_array_equal(np.asarray(ours.in_proj_b[...])[:, g * r:(g + 1) * r].T, ba[2 * g * r:2 * g * r + r])
        np.testing.assert_array_equal(np.asarray(ours.in_proj_a[...])[:, g * r:(g + 1) * r].T,
                                      ba[2 * g * r + r:2 * (g + 1) * r])


def test_peft_export_refuses_the_fused_projections(tmp_path):
    from areal_jax.models.peft_io import save_peft_adapter

    model = testing.random_model(testing.tiny_config("qwen3_next", num_layers=4), seed=0)
    adapted = lora.apply_lora(model, lora.LoRAConfig(targets="in_qkv,out"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_qkv: this model's HF form fuses it"):
        save_peft_adapter(adapted, lora.LoRAConfig(targets="in_qkv,out"), tmp_path / "peft")
