"""Granite 3.x (GraniteForCausalLM), Granite 3 MoE (GraniteMoeForCausalLM) and Granite MoE Shared
(GraniteMoeSharedForCausalLM: Granite 3 MoE's experts plus an ungated shared MLP): the four scalars (embeddings, residual
branches, attention scale, logits) in the forward, the trainer's chunked log-probs with their gradient, and the
sampler; against HF transformers (PyTorch, float32) where installed: logits, byte-identical round trips through
GraniteMoe's stacked expert tensors, and what the real checkpoints' config.json says."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import Transformer, load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import read_safetensors_dir
from areal_jax.testing import models as testing
from areal_jax.testing.hf import hf_logits, random_tokens, randomize_torch

SCALARS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=2.0)


def test_each_scalar_changes_the_forward_as_its_formula_says():
    """Against the Llama layer with the scalars off: logits_scaling divides the logits exactly; the others change
    them; attention_multiplier = head_dim ** -0.5 and multipliers of 1 give the plain layer back."""
    plain = testing.random_model(testing.tiny_config("llama", rope_scaling=None), seed=1)
    tokens = jnp.asarray(random_tokens(97, (2, 12)))
    want = np.asarray(plain(tokens))

    def with_(**kw):
        model = Transformer(plain.cfg.replace(architecture="granite", **kw), rngs=nnx.Rngs(0))
        nnx.update(model, nnx.state(plain))
        return np.asarray(model(tokens))

    same = with_(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=16 ** -0.5, logits_scaling=1.0)
    np.testing.assert_allclose(same, want, atol=1e-5)
    np.testing.assert_allclose(with_(logits_scaling=4.0), want / 4.0, rtol=1e-6, atol=1e-6)
    for key, value in SCALARS.items():
        if key != "logits_scaling":
            assert np.abs(with_(**{key: value}) - want).max() > 1e-2, key


def test_chunked_logprobs_divide_the_logits_with_their_gradient():
    from areal_jax.trainer.logprobs import chunked_logprobs

    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.normal(size=(2, 13, 24)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(24, 50)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, (2, 13)), jnp.int32)
    u = jnp.asarray(rng.normal(size=(2, 13)), jnp.float32)
    for scaling, cap in ((6.0, None), (3.0, 2.0)):  # Granite's; and both with Gemma 2's cap (divide, then cap)

        def direct(h, w):
            logits = (h @ w) / scaling
            logits = logits if cap is None else cap * jnp.tanh(logits / cap)
            logp = jax.nn.log_softmax(logits, -1)
            ent = -jnp.sum(jnp.exp(logp) * logp, -1)
            return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], ent

        def chunked(h, w):
            return chunked_logprobs(h, w, targets, chunk=4, softcap=cap, scaling=scaling)

        for a, b in zip(chunked(h, w), direct(h, w)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)

        def loss(fn):
            return lambda h, w: jnp.sum(u * fn(h, w)[0]) + 0.3 * jnp.sum(fn(h, w)[1])

        got = jax.grad(loss(chunked), argnums=(0, 1))(h, w)
        ref = jax.grad(loss(direct), argnums=(0, 1))(h, w)
        for a, b in zip(got, ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


@pytest.mark.parametrize("arch", ["granite", "granitemoe", "granitemoeshared"])
def test_sampler_decodes_granite_as_its_full_forward(arch):
    from areal_jax.testing.sampler import assert_greedy_decode_is_full_forward

    model = testing.random_model(testing.tiny_config(arch), seed=3)
    assert_greedy_decode_is_full_forward(model, [[5, 9, 13, 2, 40, 41], [7, 30], [11, 12, 13]])


def test_granite_config_layouts():
    """What the real checkpoints' config.json says (the keys that matter), read as transformers reads them."""
    dense = {  # ibm-granite/granite-3.3-2b-instruct
        "architectures": ["GraniteForCausalLM"], "model_type": "granite", "vocab_size": 49159, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rope_theta": 10000000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0}
    cfg = ModelConfig.from_hf_dict(dense)
    assert cfg.architecture == "granite" and cfg.logits_scaling == 8.0 and cfg.attention_scale_factor == 0.015625 * 8
    assert round(cfg.num_params / 1e9, 2) == 2.53
    moe = {  # ibm-granite/granite-3.1-1b-a400m-instruct
        "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", "vocab_size": 49155, "hidden_size": 1024,
        "intermediate_size": 512, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8,
        "num_local_experts": 32, "num_experts_per_tok": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
        "rope_theta": 10000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 6.0}
    cfg = ModelConfig.from_hf_dict(moe)
    assert cfg.num_experts == 32 and cfg.norm_topk_prob and cfg.expert_size == 512
    assert round(cfg.num_params / 1e9, 2) == 1.33  # "1.3B parameters, 400M active"
    shared = ModelConfig.from_hf_dict({**moe, "architectures": ["GraniteMoeSharedForCausalLM"],
                                       "model_type": "granitemoeshared", "shared_intermediate_size": 1024})
    assert shared.shared_expert_size == 1024 and not shared.shared_expert_gated
    assert shared.num_params - cfg.num_params == 24 * 3 * 1024 * 1024  # (gate, up and down of the shared MLP a layer)
    assert ModelConfig.from_hf_dict({**moe, "model_type": "granitemoeshared"}).shared_expert_size is None
    with pytest.raises(ValueError, match="shared expert is added ungated; set shared_expert_gated=False"):
        testing.tiny_config("granitemoeshared", shared_expert_gated=True).to_hf_dict()
    with pytest.raises(ValueError, match="are Granite's"):
        testing.tiny_config("llama", logits_scaling=2.0).to_hf_dict()
    with pytest.raises(ValueError, match="logits_scaling must be a positive number"):
        testing.tiny_config("granite", logits_scaling=0.0)


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["granite", "granitemoe", "granitemoeshared"])
def test_granite_matches_transformers_and_round_trips(tmp_path, arch):
    torch = pytest.importorskip("torch", reason="parity tests need PyTorch (pip install areal_jax[parity])")
    transformers = pytest.importorskip("transformers", reason="parity tests need transformers (areal_jax[parity])")
    shape = dict(vocab_size=101, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=arch == "granite", **SCALARS)
    if arch == "granite":
        hf = transformers.GraniteForCausalLM(transformers.GraniteConfig(**shape))
    elif arch == "granitemoe":
        hf = transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(**shape, num_local_experts=4,
                                                                             num_experts_per_tok=2))
    else:  # the shared MLP (shared_mlp.input_linear: gate and up rows; output_linear), added to the experts' output
        hf = transformers.GraniteMoeSharedForCausalLM(transformers.GraniteMoeSharedConfig(
            **shape, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40))
    hf = randomize_torch(hf.eval(), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf")
    assert ours.cfg.architecture == arch and ours.cfg.residual_multiplier == 0.22
    assert ours.cfg.shared_expert_size == (40 if arch == "granitemoeshared" else None)
    assert ours.cfg.num_params == sum(p.numel() for p in hf.parameters())
    tokens = random_tokens(101, (2, 30), seed=2)
    ref = hf_logits(hf, tokens)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    save_hf_checkpoint(ours, tmp_path / "ours")
    before, after = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "ours")
    assert before.keys() == after.keys()
    for name, tensor in before.items():  # GraniteMoe's input_linear: gate and up split on loading, stacked again
        assert tensor.tobytes() == after[name].tobytes(), name
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(again, tokens), ref)
    theirs = testing.write_random_hf_checkpoint(tmp_path / "tiny", testing.tiny_config(arch), seed=5)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float32).eval()
    np.testing.assert_allclose(np.asarray(theirs(jnp.asarray(tokens % 97))), hf_logits(loaded, tokens % 97), atol=1e-4)
