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
from areal_jax.testing.hf import randomize_lora_b


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


def test_peft_adapters_of_the_fused_projections_are_the_merged_update(tmp_path):
    """A PEFT adapter of in_proj_qkvz / in_proj_ba (rank n x r, B's rows where the fused weight interleaves each
    part's): scale * B @ A equals what the merged export adds to that fused weight (hf_names' layout, not peft_io's),
    whether both parts are adapted (q/k/v and z) or one (a of b, a). tests/test_lora_export.py: peft applies it."""

    from areal_jax.models import save_hf_checkpoint
    from areal_jax.models.hf_io import read_safetensors_dir
    from areal_jax.models.peft_io import peft_tensors

    model = testing.random_model(testing.tiny_config("qwen3_next", num_layers=4), seed=0)
    save_hf_checkpoint(model, tmp_path / "base")
    cfg = lora.LoRAConfig(rank=3, alpha=6.0, targets="in_qkv,in_z,in_a")
    lora.apply_lora(model, cfg, rngs=nnx.Rngs(0))
    randomize_lora_b(model, 0.3, offset=0)
    save_hf_checkpoint(lora.merged_model(model, cfg.scale), tmp_path / "merged")
    base, merged, tensors = read_safetensors_dir(tmp_path / "base"), read_safetensors_dir(tmp_path / "merged"), \
        peft_tensors(model)
    checked = 0
    for i in range(4):
        for module, parts in (("in_proj_qkvz", 2), ("in_proj_ba", 1)):
            name = f"model.layers.{i}.linear_attn.{module}"
            if f"{name}.weight" not in base:  # an attention layer
                continue
            a, b = tensors[f"base_model.model.{name}.lora_A.weight"], tensors[f"base_model.model.{name}.lora_B.weight"]
            assert a.shape[0] == b.shape[1] == 3 * parts and b.shape[0] == base[f"{name}.weight"].shape[0]
            update = merged[f"{name}.weight"] - base[f"{name}.weight"]
            assert np.abs(update).max() > 0.1
            np.testing.assert_allclose(cfg.scale * b @ a, update, atol=1e-5, rtol=0)
            checked += 1
    assert checked == 6
