"""Qwen3.5 (Qwen3_5ForCausalLM, and the text decoder of Qwen3_5ForConditionalGeneration) and Qwen3.5-MoE: Gated
DeltaNet layers beside gated attention (the MoE's feed-forward Qwen2-MoE's). The delta rule against transformers' token-by-token reference (packed segments, chunk boundaries,
a carried state, gradients against a token-by-token scan), logits and round trips against transformers' classes (the
image-and-text checkpoint too), packed rows, the sampler against full forwards, the memory plan against what the
engine allocates, and the errors that say what differs."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.config import ModelConfig
from areal_jax.models.gated_deltanet import delta_rule, delta_step, flat_delta_step, l2_normalize, unit_lower_inverse
from areal_jax.testing import models as testing
from areal_jax.testing.hf import assert_parity_and_round_trips, hf_model_of, random_tokens, randomize_torch

# A Qwen3.5-0.8B-shaped text_config as the image-and-text checkpoints write it (sizes shrunk; no layer_types, so the
# default pattern: every fourth layer attention)
_IMAGE_AND_TEXT = {
    "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "eos_token_id": 7,
    "tie_word_embeddings": True,  # transformers ties these models' weights by the outer flag (default False)
    "text_config": {"model_type": "qwen3_5_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "tie_word_embeddings": True,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                        "mrope_section": [11, 11, 10], "mrope_interleaved": True}},
    "vision_config": {"depth": 2}}


def _inputs(b=2, t=150, h=3, dk=8, dv=6, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(b, t, h, dk)), rng.normal(size=(b, t, h, dk))
    v = rng.normal(size=(b, t, h, dv))
    g = -0.3 * np.abs(rng.normal(size=(b, t, h)))
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, t, h))))
    return [x.astype(np.float32) for x in (q, k, v, g, beta)]


def test_config_of_an_image_and_text_checkpoint_and_refusals():
    cfg = ModelConfig.from_hf_dict(_IMAGE_AND_TEXT)
    assert cfg.architecture == "qwen3_5_text" and cfg.eos_token_id == 7 and cfg.tie_word_embeddings
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 1e7 and cfg.rope_scaling is None  # mrope: plain RoPE for text
    assert tuple(cfg.linear) == (2, 4, 16, 16, 4, 1.0) and cfg.qk_norm and cfg.norm_offset
    again = ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg and cfg.to_hf_dict()["architectures"] == ["Qwen3_5ForCausalLM"]
    untied = {k: v for k, v in _IMAGE_AND_TEXT.items() if k != "tie_word_embeddings"}  # text_config's True is not read
    assert not ModelConfig.from_hf_dict(untied).tie_word_embeddings
    with pytest.raises(ValueError, match="needs a text_config"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5"})
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        ModelConfig.from_hf_dict({**_IMAGE_AND_TEXT["text_config"], "attention_bias": True})
    with pytest.raises(ValueError, match="linear is None"):
        testing.tiny_config("qwen3_5_text", linear=None)
    with pytest.raises(ValueError, match="value_heads a multiple of key_heads"):
        testing.tiny_config("qwen3_5_text", linear=(3, 4, 8, 8, 4))


@pytest.mark.parity
def test_delta_rule_matches_transformers_recurrence():
    """Chunked (64 tokens, 150 of them: a partial last chunk), with packed segments (a reset inside a chunk and one
    on a chunk boundary) and with a carried state, against transformers' token-by-token reference."""
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    reference = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5").torch_recurrent_gated_delta_rule
    q, k, v, g, beta = _inputs()
    qn, kn = np.asarray(l2_normalize(jnp.asarray(q))) / np.sqrt(8), np.asarray(l2_normalize(jnp.asarray(k)))

    def ref(lo, hi, rows=slice(None)):
        out, state = reference(*(torch.tensor(x[rows, lo:hi]) for x in (q, k, v)), g=torch.tensor(g[rows, lo:hi]),
                               beta=torch.tensor(beta[rows, lo:hi]), output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
        return out.numpy(), state.numpy()

    want, want_state = ref(0, 150)
    out, state = delta_rule(*map(jnp.asarray, (qn, kn, v, g, beta)))
    np.testing.assert_allclose(out, want, atol=2e-6)
    np.testing.assert_allclose(state, want_state, atol=2e-6)
    seg = np.ones((2, 150), np.int32)
    seg[0, 40:], seg[0, 64:] = 2, 3  # row 0: segments [0, 40), [40, 64), [64, 150)
    out, _ = delta_rule(*map(jnp.asarray, (qn, kn, v, g, beta)), segment_ids=jnp.asarray(seg))
    for lo, hi in ((0, 40), (40, 64), (64, 150)):
        np.testing.assert_allclose(out[0, lo:hi], ref(lo, hi, slice(0, 1))[0][0], atol=2e-6)
    np.testing.assert_allclose(out[1], want[1], atol=2e-6)
    _, head = delta_rule(*(jnp.asarray(x[:, :70]) for x in (qn, kn, v, g, beta)))
    out, state = delta_rule(*(jnp.asarray(x[:, 70:]) for x in (qn, kn, v, g, beta)), state=head)
    np.testing.assert_allclose(out, want[:, 70:], atol=2e-6)
    np.testing.assert_allclose(state, want_state, atol=2e-6)


def test_the_decode_step_on_the_buffer_layout_equals_the_step_and_the_chunked_rule():
    """`flat_delta_step` (the KV-cache decode's form, on the state as [B, 1, H * Dk, Dv]) token by token gives the
    outputs and the final state of `delta_step` on [B, H, Dk, Dv] and of the chunked rule, a tail of inert tokens
    (g = beta = 0) included."""
    q, k, v, g, beta = _inputs(t=20, seed=2)
    g[:, 15:], beta[:, 15:] = 0.0, 0.0
    qn, kn = np.asarray(l2_normalize(jnp.asarray(q))) / np.sqrt(8), np.asarray(l2_normalize(jnp.asarray(k)))
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    flat, state = jnp.zeros((b, 1, h * dk, dv)), jnp.zeros((b, h, dk, dv))
    for i in range(t):
        o_flat, flat = flat_delta_step(*(jnp.asarray(x[:, i]) for x in (qn, kn, v, g, beta)), flat)
        o, state = delta_step(*(jnp.asarray(x[:, i]) for x in (qn, kn, v, g, beta)), state)
        np.testing.assert_allclose(o_flat, o, atol=1e-6)
    np.testing.assert_allclose(flat.reshape(b, h, dk, dv), state, atol=1e-6)
    out, final = delta_rule(*map(jnp.asarray, (qn, kn, v, g, beta)))
    np.testing.assert_allclose(o_flat, out[:, -1], atol=2e-6)
    np.testing.assert_allclose(flat.reshape(b, h, dk, dv), final, atol=2e-6)


def test_the_decode_dispatch_holds_no_copy_of_each_layers_states():
    """A decode dispatch's working memory grows by far less than one layer's states (all slots) per Gated DeltaNet
    layer: the step keeps the states in their buffer's layout, so XLA updates them in place rather than copying
    them between layouts each step (which had cost 0.26 GiB a layer at the Qwen3.5-9B shape and 128 slots)."""
    from areal_jax.models.gated_deltanet import state_bytes
    from areal_jax.sampler import memory as sampler_memory
    from areal_jax.sampler.config import RolloutConfig

    cfg = testing.wide_hybrid_config(dtype=jnp.float32, param_dtype=jnp.float32)
    r = RolloutConfig(num_slots=16, max_len=256, decode_steps=4).for_prompts(32)
    three, four = (sampler_memory.program_temp_bytes(r, cfg, None, layers=n, program="decode", longest=32,
                                                     kind="linear") for n in (3, 4))
    assert four - three < 0.25 * 16 * state_bytes(cfg), (three, four)


def test_delta_rule_gradients_equal_a_token_scan_and_inert_tokens_keep_the_state():
    q, k, v, g, beta = (jnp.asarray(x) for x in _inputs(t=90, seed=1))
    q, k = l2_normalize(q) / np.sqrt(8), l2_normalize(k)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(2, 90, 3, 6)), jnp.float32)

    def scanned(q, k, v, g, beta):  # one token at a time, another way of writing the same recurrence
        def step(s, xs):
            o, s = delta_step(*xs, s)
            return s, o
        xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
        _, o = jax.lax.scan(step, jnp.zeros((2, 3, 8, 6)), xs)
        return jnp.sum(jnp.moveaxis(o, 0, 1) * w)

    def chunked(q, k, v, g, beta):
        return jnp.sum(delta_rule(q, k, v, g, beta, chunk=32)[0] * w)

    for a, b in zip(jax.grad(chunked, argnums=range(5))(q, k, v, g, beta),
                    jax.grad(scanned, argnums=range(5))(q, k, v, g, beta)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    # tokens with g = beta = 0 (padding, a finished row) leave the state as it was, wherever they sit
    inert = np.ones(90, bool)
    inert[[5, 33, 60, 61, 89]] = False
    keep = jnp.asarray(inert)[None, :, None]
    _, s_masked = delta_rule(q, k, v, jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0))
    _, s_dropped = delta_rule(*(x[:, inert] for x in (q, k, v, g, beta)))
    np.testing.assert_allclose(s_masked, s_dropped, atol=2e-6)


@pytest.mark.parametrize("c", [1, 2, 7, 16, 24, 64])
def test_unit_lower_inverse_equals_numpy_and_the_backward_calls_no_lapack(c):
    rng = np.random.default_rng(c)
    t = (np.tril(rng.normal(size=(3, 2, c, c)) * 0.3, -1) + np.eye(c)).astype(np.float32)
    inv = np.asarray(unit_lower_inverse(jnp.asarray(t)))
    np.testing.assert_allclose(inv, np.linalg.inv(t.astype(np.float64)), atol=1e-5)
    assert np.all(np.triu(inv, 1) == 0) and np.all(np.diagonal(inv, axis1=-2, axis2=-1) == 1)
    if c == 64:  # the chunked rule's forward and backward are matrix products: no batched LAPACK call, whose
        # concurrent runs on a 2-thread CPU pool were seen to wait on each other for good
        q, k, v, g, beta = (jnp.asarray(x) for x in _inputs(t=130))
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(delta_rule(q, k, v, g, beta)[0]), argnums=(0, 1, 2)))
        assert "custom-call" not in grad.lower(q, k, v).compile().as_text()


def test_released_shapes_parameter_counts():
    """transformers' defaults are Qwen3.5-9B's text decoder and Qwen3.5-35B-A3B's (the cards: 9B with the vision
    tower; 35B, 3B active): the counts here, worked from the shapes (tests/test_models.py checks them against built
    models)."""
    dense = ModelConfig.from_hf_dict({"model_type": "qwen3_5_text"})
    moe = ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe_text"})
    assert dense.num_params == 8_953_803_264 and moe.num_params == 34_660_610_688
    assert moe.num_experts == 256 and moe.num_experts_per_tok == 8 and moe.shared_expert_size == 512
    # active: the decoder's matrices a token goes through, plus its embedding row and the unembedding
    assert 2.9e9 < moe.matmul_params_per_token + moe.vocab_size * moe.hidden_size < 3.1e9


@pytest.mark.parity
@pytest.mark.parametrize("arch,overrides", [
    ("qwen3_5_text", {"num_layers": 4}),
    ("qwen3_5_text", {"num_layers": 2, "linear": (2, 2, 8, 8, 3), "tie_word_embeddings": True, "num_kv_heads": 1}),
    ("qwen3_5_moe_text", {"num_layers": 4}), ("qwen3_next", {"num_layers": 4})])
def test_model_matches_transformers_and_round_trips(tmp_path, arch, overrides):
    pytest.importorskip("torch", reason="parity tests need PyTorch")
    pytest.importorskip("transformers", reason="parity tests need transformers")
    cfg = testing.tiny_config(arch, **overrides)
    hf = hf_model_of(cfg, seed=1)
    # atol: two float32 forms of the chunked rule part by up to ~5e-4 at logits of up to ~70 (tied embeddings); against
    # transformers in float64 ours was off by 2.7e-4 there and its own float32 forward by 3.5e-4
    ours = assert_parity_and_round_trips(tmp_path, cfg, hf, random_tokens(97, (2, 80), seed=2), atol=1e-3)
    want = hf.model.layers[0].linear_attn.conv1d.weight.detach().numpy()  # [C, 1, K] on disk, [K, C] here, its
    # channels grouped key head by key head: head 0's query and key, then its value heads' values, then head 1's ...
    m = cfg.linear
    head0 = np.r_[0:m.key_dim, m.key_heads * m.key_dim + np.arange(m.key_dim),
                  2 * m.key_heads * m.key_dim + np.arange(m.value_heads // m.key_heads * m.value_dim)]
    got = np.asarray(ours.layers[0].linear_attn.conv[...])
    np.testing.assert_array_equal(got[:, :head0.size], want[head0, 0].T)
    np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(want[:, 0].T, axis=1))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parity
def test_an_image_and_text_checkpoint_loads_its_text_decoder(tmp_path):
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers")
    from areal_jax.models import load_hf_checkpoint

    cfg = testing.tiny_config("qwen3_5_text", num_layers=4)
    text = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    hf = randomize_torch(transformers.Qwen3_5ForConditionalGeneration(config).eval(), seed=4)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    assert ours.cfg == cfg  # the vision tower's tensors are left on disk
    tokens = random_tokens(97, (2, 30), seed=2)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), want, atol=1e-4, rtol=0)
    # saved text-only, then written back into the image-and-text checkpoint (the export program's default)
    from areal_jax.testing.hf import rewrapped_logits

    again = rewrapped_logits(ours, tmp_path, tmp_path / "export", transformers.Qwen3_5ForConditionalGeneration, tokens)
    np.testing.assert_allclose(again, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,page_size", [("qwen3_5_text", None), ("qwen3_5_text", 8), ("qwen3_5_moe_text", None),
                                            ("qwen3_next", 8)])
def test_sampler_decodes_as_its_full_forward(arch, page_size):
    """The dense cache, and pages with the Gated DeltaNet states as ring rows beside them: three prompts through two
    slots (a slot's state is replaced whole when it takes the next prompt), four decode steps a dispatch."""
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config(arch, num_layers=4), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size)


@pytest.mark.parametrize("page_size", [None, 8])
def test_sampler_on_a_tensor_axis_splits_the_gated_deltanet_by_value_heads(page_size):
    """Rollout tensor parallelism: the Gated DeltaNet's z / b / a / out projections (and its decay parameters) split
    by value heads like attention's, in_proj_qkv and conv by key heads (its channels grouped by head), the cache's
    windows and states over the same axis; greedy decoding as by full forwards."""
    from jax.sharding import Mesh, PartitionSpec

    from areal_jax.models import shard_params
    from areal_jax.models.sharding import logical_names
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tensor"))
    model = testing.random_model(testing.tiny_config("qwen3_5_text", num_layers=4, num_kv_heads=2), seed=3)
    specs = {name: logical_names(getattr(model.layers[0].linear_attn, name)) for name in ("in_proj_z", "out_proj", "A_log")}
    assert specs == {"in_proj_z": ("embed", "heads"), "out_proj": ("heads", "embed"), "A_log": ("heads",)}
    placed = shard_params(testing.random_model(model.cfg, seed=3), mesh).layers[0].linear_attn
    assert placed.out_proj[...].sharding.spec == PartitionSpec("tensor", None)
    assert placed.in_proj_qkv[...].sharding.spec == PartitionSpec(None, "tensor")  # key head by key head
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41, 7, 8, 9, 10], [7, 30], [11, 12, 13]],
                                         page_size=page_size, mesh=mesh)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
@pytest.mark.parametrize("arch,stateless", [("qwen3_5_text", {"linear": None}), ("lfm2", {"short_conv": None}),
                                            ("granitemoehybrid", {"mamba": None})])
def test_memory_plan_counts_the_states_as_allocated(kv_cache, arch, stateless):
    """`kv_cache_bytes` equals what the engine allocates (attention layers' keys and values, or their pages; each
    stateful layer's window and state per slot and standby row: a Gated DeltaNet's or Mamba-2's float32 state, an LFM2
    conv layer's window alone; logits), on one device and per device of a 2-device tensor axis (the windows and states
    split as the cache), and is below that of the model in attention."""
    from areal_jax.sampler.config import RolloutConfig
    from areal_jax.system.memory import kv_cache_bytes

    mamba = {"mamba": (4, 32, 16, 2, 4), "layer_types": ("linear_attention", "full_attention") * 2}
    model = testing.random_model(testing.tiny_config(arch, num_layers=4, **(mamba if "mamba" in stateless else {})),
                                 seed=0)
    rollout = RolloutConfig(num_slots=4, group_size=2, max_len=64, standby_rows=2, standby_len=16, kv_cache=kv_cache,
                            page_size=4, kv_pages=40)
    from jax.sharding import Mesh

    from areal_jax.testing.sampler import cache_bytes_laid_out

    allocated = cache_bytes_laid_out(rollout, model)
    assert kv_cache_bytes(model.cfg, rollout, 1) == allocated
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tensor"))  # per device, split by the tensor axis
    split = cache_bytes_laid_out(rollout, model, mesh)
    assert kv_cache_bytes(model.cfg, rollout, 2) == split < allocated
    attention = testing.tiny_config(arch, num_layers=4, layer_types=None, **stateless)
    if "mamba" not in stateless:  # (a Mamba-2 state, 128 x 16 floats a row and layer here, outweighs 64 positions)
        assert kv_cache_bytes(model.cfg, rollout, 1) < kv_cache_bytes(attention, rollout, 1)


def test_layers_scan_in_groups_of_three_linear_and_one_attention():
    """Nine layers (two groups of three Gated DeltaNet layers and one of attention, then one more): the cache-free
    forward scans the two groups (each place in the group its own structure) and unrolls the last; values and
    gradients as the unrolled loop's, on packed rows."""
    from flax import nnx


    types = (("linear_attention",) * 3 + ("full_attention",)) * 2 + ("linear_attention",)
    cfg = testing.tiny_config("qwen3_5_text", num_layers=9, layer_types=types, hidden_size=32, intermediate_size=48,
                              num_heads=2, num_kv_heads=1, max_position_embeddings=512)
    graphdef, params = nnx.split(testing.random_model(cfg, seed=3))
    lengths = [[80, 60, 40], [100, 92]]  # two packed rows of 192 (the first ends in padding, segment 0)
    seg, pos = np.zeros((2, 192), np.int32), np.zeros((2, 192), np.int32)
    for r, row in enumerate(lengths):
        starts = np.cumsum([0] + row)
        for s, (a, n) in enumerate(zip(starts, row)):
            seg[r, a:a + n], pos[r, a:a + n] = s + 1, np.arange(n)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 192)), jnp.int32)
    seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(2, 192, cfg.hidden_size)), jnp.float32)

    def loss(p, scan):
        h = nnx.merge(graphdef, p).hidden(tokens, pos, seg, attention="dense", remat="full", scan_layers=scan)
        return jnp.sum(h * w)

    lengths = re.findall(r"length=(\d+)", str(jax.make_jaxpr(lambda p: loss(p, True))(params)))
    assert sorted(set(lengths)) == ["2", "3"]  # the scan over the two groups; the delta rule's over its 3 chunks
    (v0, g0), (v1, g1) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, s) for s in (False, True))
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-4 * float(jnp.abs(a).max()))


@pytest.mark.long  # 40-120 s; in CI the sampler's tensor-parallel test covers the sharded layer's decoding
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_forward_and_gradients_match_one_device(axis_type):
    """On a 2 x 2 (fsdp, tensor) mesh: the cache-free forward over packed rows and its gradients, and the cache
    path, as on one device (the Gated DeltaNet projections sharded over fsdp, and by heads over tensor, the
    attention layer over both)."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(getattr(AxisType, axis_type),) * 2)
    # (float32 reduction orders: sharded, the cache path was 5.5e-5 off at logits up to 6.5, and the cache-free
    # forward 3.8e-5 off on a 4 x 1 mesh that splits no head at all)
    testing.assert_sharded_forward_matches_one_device(testing.tiny_config("qwen3_5_text", num_layers=4), mesh,
                                                      lambda model: model.layers[0].linear_attn.in_proj_qkv)
