"""gpt-oss (GptOssForCausalLM): the config.json of the released models read as transformers reads it, the MXFP4
expert tensors dequantised as transformers dequantises them, the experts (biases, clamped GLU, interleaved gate/up)
on every expert path against transformers' block, and the whole model: logits against transformers, checkpoint
round trips (plain and MXFP4), the sampler against full forwards, and a training step's gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.config import ModelConfig
from areal_jax.models.gpt_oss import dequantize_mxfp4
from areal_jax.models.hf_io import read_safetensors_dir
from areal_jax.models.moe import MoE, glu
from areal_jax.testing import models as testing
from areal_jax.testing.hf import hf_logits, random_tokens, randomize_torch

GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json, the keys that matter
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
    "rope_theta": 150000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "attention_bias": True, "hidden_act": "silu", "initial_context_length": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "eos_token_id": 200002, "pad_token_id": 199999,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}}


def test_released_configs_read_as_transformers_reads_them():
    cfg = ModelConfig.from_hf_dict(GPT_OSS_20B)
    assert cfg.architecture == "gpt_oss" and cfg.attention_sinks and cfg.attention_out_bias and cfg.attention_bias
    assert cfg.expert_bias and cfg.swiglu_limit == 7.0 and cfg.swiglu_alpha == 1.702 and cfg.norm_topk_prob
    assert [cfg.layer_window(i) for i in range(3)] == [128, None, 128] and cfg.rope_theta == 150000.0
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    # the model card: 20.91B parameters, 3.61B active (the unembedding counted)
    assert round(cfg.num_params / 1e9, 2) == 20.91
    assert round((cfg.matmul_params_per_token + cfg.vocab_size * cfg.hidden_size) / 1e9, 2) == 3.61
    big = ModelConfig.from_hf_dict({**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                                    "layer_types": ["sliding_attention", "full_attention"] * 18})
    assert round(big.num_params / 1e9, 2) == 116.83  # gpt-oss-120b
    again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg
    with pytest.raises(ValueError, match="are gpt-oss's"):
        testing.tiny_config("llama", attention_sinks=True).to_hf_dict()
    with pytest.raises(ValueError, match="set attention_sinks"):
        testing.tiny_config("gpt_oss", attention_sinks=False).to_hf_dict()
    with pytest.raises(ValueError, match="swiglu_limit must be a positive number"):
        testing.tiny_config("gpt_oss", swiglu_limit=0.0)
    with pytest.raises(ValueError, match="apply to a mixture of experts"):
        testing.tiny_config("llama", expert_bias=True)


def test_mxfp4_dequantisation_by_hand_and_against_transformers():
    blocks = np.array([[[[0x21] + [0x00] * 15]]], np.uint8)  # low nibble 1 (0.5), high nibble 2 (1.0)
    scales = np.array([[[129]]], np.uint8)  # 2 ** 2
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (1, 32, 1) and got[0, 0, 0] == 2.0 and got[0, 1, 0] == 4.0 and not got[0, 2:].any()
    got = dequantize_mxfp4(np.array([[[[0xF9] * 16]]], np.uint8), np.array([[[126]]], np.uint8))
    assert set(got.ravel()) == {-0.25, -3.0}  # nibble 9: -0.5, nibble 15: -6, each times 2 ** -1
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4", reason="needs transformers")
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (3, 40, 2), dtype=np.uint8)
    torch = pytest.importorskip("torch")
    want = mxfp4.convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), want)
    with pytest.raises(ValueError, match="MXFP4 tensors need"):
        dequantize_mxfp4(blocks, scales[..., :1])


def test_clamped_glu_by_hand():
    g = jnp.array([-2.0, 0.5, 3.0])
    u = jnp.array([5.0, -0.3, -4.0])
    got = np.asarray(glu(1.0, 1.702)(g, u))
    gc, uc = np.minimum(np.asarray(g), 1.0), np.clip(np.asarray(u), -1.0, 1.0)
    np.testing.assert_allclose(got, (uc + 1) * gc / (1 + np.exp(-1.702 * gc)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(glu()(g, u)), np.asarray(jax.nn.silu(g) * u), rtol=1e-6)


def _our_moe_from_hf(block, cfg: ModelConfig) -> MoE:
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    t = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    moe.router[...] = jnp.asarray(t["router.weight"].T)
    moe.router_bias[...] = jnp.asarray(t["router.bias"])
    moe.experts_gate[...], moe.experts_up[...] = (jnp.asarray(t["experts.gate_up_proj"][..., j::2]) for j in (0, 1))
    moe.experts_gate_bias[...], moe.experts_up_bias[...] = (
        jnp.asarray(t["experts.gate_up_proj_bias"][..., j::2]) for j in (0, 1))
    moe.experts_down[...] = jnp.asarray(t["experts.down_proj"])
    moe.experts_down_bias[...] = jnp.asarray(t["experts.down_proj_bias"])
    return moe


@pytest.mark.parity
@pytest.mark.parametrize("impl", ["dense", "blocked", "ragged", "pallas"])
def test_experts_match_transformers_block_on_every_path(impl):
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = testing.tiny_config("gpt_oss", moe_impl=impl)
    hf_cfg = transformers.GptOssConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                                          if k not in ("architectures", "model_type")})
    block = randomize_torch(GptOssMLP(hf_cfg).eval(), seed=3)
    moe = _our_moe_from_hf(block, cfg)
    x = np.random.default_rng(1).normal(size=(2, 24, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.tensor(x))[0].numpy()
    gate_up = np.einsum("btd,edf->btef", x, block.experts.gate_up_proj.detach().numpy())
    assert (gate_up[..., 0::2] > 1.0).mean() > 0.02 and (np.abs(gate_up[..., 1::2]) > 1.0).mean() > 0.02  # clamps bite
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x))), want, atol=2e-5, rtol=1e-5)


def _hf_model(cfg: ModelConfig, seed: int, **hf_overrides):
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    hf_cfg = transformers.GptOssConfig(**{**{k: v for k, v in cfg.to_hf_dict().items()
                                             if k not in ("architectures", "model_type")}, **hf_overrides})
    return randomize_torch(transformers.GptOssForCausalLM(hf_cfg).eval(), seed=seed)


YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}


@pytest.mark.parity
def test_model_matches_transformers_and_round_trips(tmp_path):
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config("gpt_oss", num_layers=3, layer_types=None,
                              sliding_window=None).replace(sliding_window=8, layer_types=(
                                  "sliding_attention", "full_attention", "sliding_attention"))
    hf = _hf_model(cfg, seed=1, rope_parameters=YARN)
    hf.save_pretrained(tmp_path / "hf")
    tokens = random_tokens(97, (2, 30), seed=2)  # past several windows of 8
    ref = hf_logits(hf, tokens)
    assert np.abs(ref).max() > 1.0
    for attention in ("dense", "blocked"):
        ours = load_hf_checkpoint(tmp_path / "hf")
        assert ours.cfg.rope_scaling["rope_type"] == "yarn" and ours.cfg.layer_window(1) is None
        got = np.asarray(ours.unembed(ours.hidden(jnp.asarray(tokens), attention=attention)))
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=attention)
    save_hf_checkpoint(ours, tmp_path / "ours")
    before, after = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "ours")
    assert before.keys() == after.keys()
    for name, tensor in before.items():  # gate_up_proj (and its bias): gate and up split on loading, interleaved again
        assert tensor.tobytes() == after[name].tobytes(), name
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(again, tokens), ref)


@pytest.mark.parity
def test_mxfp4_checkpoint_loads_as_its_dequantised_weights(tmp_path):
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    from safetensors.numpy import save_file

    cfg = testing.tiny_config("gpt_oss")
    hf = _hf_model(cfg, seed=4)
    rng = np.random.default_rng(5)
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    quantised = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for name, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
                blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
                scales = rng.integers(122, 127, (e, rows, cols // 32), dtype=np.uint8)
                getattr(layer.mlp.experts, name).copy_(torch.tensor(dequantize_mxfp4(blocks, scales)))
                key = f"model.layers.{i}.mlp.experts.{name}"
                quantised.update({key + "_blocks": blocks, key + "_scales": scales})
    hf.save_pretrained(tmp_path / "plain")
    tensors = read_safetensors_dir(tmp_path / "plain")
    for key in quantised:
        tensors.pop(key.rsplit("_", 1)[0], None)
    (tmp_path / "mxfp4").mkdir()
    save_file({**tensors, **quantised}, str(tmp_path / "mxfp4" / "model.safetensors"))
    (tmp_path / "mxfp4" / "config.json").write_text((tmp_path / "plain" / "config.json").read_text())
    tokens = random_tokens(97, (2, 20), seed=6)
    ours = load_hf_checkpoint(tmp_path / "mxfp4")
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4, rtol=0)
    gate = np.asarray(ours.layers[1].mlp.experts_gate[...])
    np.testing.assert_array_equal(gate, hf.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()[..., 0::2])


def test_sampler_decodes_as_its_full_forward():
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config("gpt_oss"), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]])


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_update_gradients_on_a_2x2_mesh_equal_one_devices(impl):
    from tests.test_trainer import grads_agree_on_one_and_four_devices

    grads = grads_agree_on_one_and_four_devices(testing.tiny_config("gpt_oss", moe_impl=impl))
    sinks = [g for k, g in grads.items() if "sinks" in k or "bias" in k]
    assert len(sinks) == 2 * 9 and all(np.abs(s).max() > 0 for s in sinks)  # sinks and every bias learn
