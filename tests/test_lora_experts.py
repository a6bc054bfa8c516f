"""LoRA on a mixture of experts' expert weights (lora.targets "experts": models.lora.LoRAExperts): exact at init, the
merge against a per-expert numpy reference, the adapted forward equal to the merged model's, gradients only into the
adapters and by the chain rule through each expert's merged weight, sharding, the adapter hand-off's bytes, and the
errors (dropout, PEFT export, a dense model)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.knobs import ConfigError
from areal_jax.models import as_tree, lora
from areal_jax.runtime.mesh import MeshConfig, build_meshes
from areal_jax.sampler import generate_batch
from areal_jax.system.lora_channel import AdapterChannel, sampler_graphdef
from areal_jax.testing.models import random_model, tiny_config
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig
from tests.test_lora import one_device_mesh

CFG = tiny_config("qwen3_moe", num_layers=3, moe_layers=(1, 0, 1))  # expert layers 0 and 2 around a dense one
TOKENS = jnp.asarray(np.random.default_rng(0).integers(3, CFG.vocab_size, (2, 11)), jnp.int32)


def adapted(targets="all,experts", b_std=0.0, seed=3, **kw):
    model = random_model(CFG, seed=seed)
    lcfg = lora.LoRAConfig(rank=4, alpha=8.0, targets=targets, **kw)
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(seed + 1))
    if b_std:
        for i, (_, node) in enumerate(p for p in nnx.iter_graph(model)
                                      if isinstance(p[1], (lora.LoRAProjection, lora.LoRAExperts))):
            node.lora_b.set_value(b_std * jax.random.normal(jax.random.key(100 + i), node.lora_b.shape))
    return model, lcfg


def test_expert_targets_and_exact_init():
    cfg = lora.LoRAConfig(targets="experts")
    assert cfg.target_paths(3, experts=(0, 2)) == [(0, "experts_gate"), (0, "experts_up"), (0, "experts_down"),
                                                   (2, "experts_gate"), (2, "experts_up"), (2, "experts_down")]
    pattern = lora.LoRAConfig(targets="q,re:layers\\.2\\.mlp\\.experts_down")
    assert pattern.target_paths(3, experts=(0, 2)) == [(0, "q"), (1, "q"), (2, "q"), (2, "experts_down")]
    assert all(s not in lora.EXPERTS for _, s in lora.LoRAConfig(targets="all").target_paths(3, experts=(0, 2)))
    model, _ = adapted()
    moe = model.layers[0].mlp
    e, d, f = CFG.num_experts, CFG.hidden_size, CFG.expert_size
    assert isinstance(moe.experts_gate, lora.LoRAExperts) and moe.experts_gate.lora_a.shape == (e, d, 4)
    assert moe.experts_gate.lora_b.shape == (e, 4, f) and moe.experts_down.lora_b.shape == (e, 4, d)
    assert isinstance(model.layers[1].mlp.up_proj, lora.LoRAProjection)
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), np.asarray(random_model(CFG, seed=3)(TOKENS)))


def test_merge_matches_a_per_expert_reference_and_the_merged_model_the_adapted_one():
    rng = np.random.default_rng(0)
    w, a, b = rng.normal(size=(3, 5, 7)), rng.normal(size=(3, 5, 2)), rng.normal(size=(3, 2, 7))
    got = lora.merge_experts(jnp.asarray(w, jnp.float32), jnp.asarray(a), jnp.asarray(b), 0.5)
    want = np.stack([w[e] + 0.5 * a[e] @ b[e] for e in range(3)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    model, lcfg = adapted(b_std=0.3)
    plain = lora.merged_model(model, lcfg.scale)
    assert not lora.has_lora(plain)
    assert np.abs(np.asarray(model(TOKENS)) - np.asarray(random_model(CFG, seed=3)(TOKENS))).max() > 0.05
    np.testing.assert_allclose(np.asarray(plain(TOKENS)), np.asarray(model(TOKENS)), rtol=1e-4, atol=1e-4)
    experts_only, _ = adapted("experts", b_std=0.3)  # the experts' adapters alone move the model too
    assert np.abs(np.asarray(experts_only(TOKENS)) - np.asarray(random_model(CFG, seed=3)(TOKENS))).max() > 0.05


def test_expert_gradients_follow_the_chain_rule_and_only_adapters_train():
    """dL/dB_e = s A_e^T dL/dW_e and dL/dA_e = s dL/dW_e B_e^T, with dL/dW from full fine-tuning of the merged
    model; an update moves the adapters and leaves every frozen weight as it was."""
    model, lcfg = adapted(b_std=0.3)
    trajs = random_trajectories(6, vocab=CFG.vocab_size, seed=1, min_len=8, max_len=20)
    tc = TrainerConfig(lr=1e-2, micro_batch_tokens=64, logits_chunk=16, loss="ppo")
    lora_tr = Trainer(model, tc, one_device_mesh(), wrt=nnx.LoRAParam)
    full_tr = Trainer(lora.merged_model(model, lcfg.scale), tc, one_device_mesh())
    loss_l, g_lora = lora_tr.loss_and_grads(trajs)
    loss_f, g_full = full_tr.loss_and_grads(trajs)
    assert abs(loss_l - loss_f) < 1e-5
    for i, name in [(0, "experts_gate"), (2, "experts_down")]:
        node = getattr(model.layers[i].mlp, name)
        a, b = np.asarray(node.lora_a[...]), np.asarray(node.lora_b[...])
        gw = np.asarray(g_full["layers"][i]["mlp"][name][...])
        gl = g_lora["layers"][i]["mlp"][name]
        np.testing.assert_allclose(np.asarray(gl["lora_b"][...]), lcfg.scale * np.einsum("eir,eio->ero", a, gw),
                                   rtol=2e-3, atol=1e-6)
        np.testing.assert_allclose(np.asarray(gl["lora_a"][...]), lcfg.scale * np.einsum("eio,ero->eir", gw, b),
                                   rtol=2e-3, atol=1e-6)
    frozen = jax.device_get(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    before = jax.device_get(lora_tr.state.params)
    lora_tr.update(trajs)
    after = jax.device_get(lora_tr.params)
    for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(nnx.filter_state(after, nnx.All(
            nnx.Param, nnx.Not(nnx.LoRAParam))))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert min(np.abs(np.asarray(x) - np.asarray(y)).max()
               for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(lora_tr.state.params))) > 0


def test_expert_adapters_shard_like_their_experts_and_cross_alone():
    meshes = build_meshes(MeshConfig(colocated=True, fsdp=2, tensor=2))
    model, lcfg = adapted(b_std=0.3)
    tr = Trainer(model, TrainerConfig(), meshes.train_mesh, wrt=nnx.LoRAParam)
    gate = tr.state.params["layers"][0]["mlp"]["experts_gate"]
    spec = lambda v: tuple(v.get_value().sharding.spec)  # noqa: E731
    # [experts, embed, rank], [experts, rank, mlp]: each device's experts' factors (expert parallelism over fsdp)
    assert spec(gate["lora_a"]) == ("fsdp", None, None)
    assert spec(gate["lora_b"]) == ("fsdp", None, "tensor")
    channel = AdapterChannel(tr.params, meshes.rollout_mesh, scale=lcfg.scale, mode="merged")
    got = channel.publish(1, tr.params)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert channel.last_bytes == adapter_bytes == lora.adapter_bytes(model.cfg, lcfg)
    decoder = nnx.merge(sampler_graphdef(model, "merged"), as_tree(got))
    np.testing.assert_allclose(np.asarray(decoder(TOKENS)), np.asarray(model(TOKENS)), rtol=1e-4, atol=1e-4)


@pytest.mark.long  # 22 s; merged experts' logits equal the adapted ones: the test above
def test_merged_and_unmerged_decoding_give_the_same_greedy_tokens():
    model, lcfg = adapted(b_std=0.3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, CFG.vocab_size, int(n)).tolist() for n in rng.integers(3, 12, 5)]
    kw = dict(max_new_tokens=10, temperature=0.0, num_slots=4)
    unmerged = [list(c.tokens) for c in generate_batch(nnx.merge(lora.sampler_graphdef(model), nnx.state(model)),
                                                       prompts, **kw)]
    merged = [list(c.tokens) for c in generate_batch(lora.merged_model(model, lcfg.scale), prompts, **kw)]
    assert unmerged == merged


def test_expert_adapter_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"lora.dropout=0.1 applies to projections only"):
        lora.LoRAConfig(targets="experts", dropout=0.1).check()
    lora.LoRAConfig(targets="attn", dropout=0.1).check()
    with pytest.raises(ValueError, match="selects no projection"):
        lora.apply_lora(random_model(tiny_config("qwen3"), seed=0), lora.LoRAConfig(targets="experts"),
                        rngs=nnx.Rngs(0))


@pytest.mark.long  # (excluded from the default run: `-m long`)
def test_a_lora_run_on_a_mixture_of_experts_trains_the_experts_adapters(tmp_path):
    """A whole Qwen3-MoE run with adapters on attention and experts, exported to HF every step: the behaviour log-probs
    equal a full forward of the exported model of their version, the sampler's last weights the last export's (the
    hand-off merges the experts' adapters too), and the exports moved in the experts and the attention, not in the
    frozen embeddings or the router."""
    import dataclasses
    import functools
    import json
    import os

    from areal_jax.data.math_tokenizer import build_math_tokenizer
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.models.hf_io import save_hf_checkpoint
    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config as tiny_job

    tok = build_math_tokenizer()
    model_dir = str(tmp_path / "moe")
    cfg = tiny_config("qwen3_moe", num_layers=3, moe_layers=(1, 0, 1), vocab_size=tok.vocab_size,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    start = random_model(cfg, seed=0)
    start.embedding.set_value(start.embedding[...] * 0.1)  # flatter logits: sampled tokens whose log-probs can move
    save_hf_checkpoint(start, model_dir)
    tok.save_pretrained(model_dir)
    c = tiny_job(str(tmp_path), eta=1, steps=2)
    c.model.path = model_dir
    c.lora.enabled, c.lora.targets, c.lora.rank = True, "attn,experts", 4
    c.train.lr = 5e-3
    c.checkpoint.hf_every_steps = 1
    trained = []
    job = RLJob(c, log_fn=lambda *a, **k: None)
    update = job.trainer.update

    def signed(trajectories):  # the tiny reward pays every sample alike here: advantages of alternating sign instead
        trained.extend(trajectories)
        return update([dataclasses.replace(t, advantage=(-1.0) ** i) for i, t in enumerate(trajectories)])

    job.trainer.update = signed
    try:
        assert job.run()["steps"] == 2
        version, sampler_params = job.sampler.versioned_params()  # what the sampler decodes with after the run
        decoder = nnx.merge(job.graphdef, jax.tree.map(jnp.asarray, jax.device_get(sampler_params)))
    finally:
        job.close()
    models = {0: load_hf_checkpoint(model_dir, max_len=c.rollout.max_len)}
    for v in (1, 2):
        models[v] = load_hf_checkpoint(os.path.join(c.run_dir, "hf", f"step_{v}"), max_len=c.rollout.max_len)
    checked = set()
    for t in trained:  # each token against the exported model of the version it is tagged with (recompute: exact)
        seq, n = np.asarray(t.tokens, np.int32), t.prompt_len
        for v in set(np.asarray(t.versions).tolist()):
            logp = jax.nn.log_softmax(models[v](jnp.asarray(seq[None]))[0], axis=-1)
            want = np.asarray(logp[n - 1:-1])[np.arange(len(seq) - n), seq[n:]]
            mine = np.asarray(t.versions) == v
            np.testing.assert_allclose(np.asarray(t.behav_logp)[mine], want[mine], atol=2e-4)
            checked.add(v)
    assert 0 in checked
    # the sampler's weights after the last hand-off: the exported model of that version, adapted experts included
    assert version == 2
    x = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 9)), jnp.int32)
    np.testing.assert_allclose(np.asarray(decoder(x)), np.asarray(models[2](x)), rtol=1e-4, atol=1e-4)
    start, end = (nnx.state(models[v]) for v in (0, 2))
    def moved(*path):
        get = lambda state: np.asarray(functools.reduce(lambda node, key: node[key], path, state)[...])  # noqa: E731
        return float(np.abs(get(end) - get(start)).max())

    assert moved("layers", 0, "mlp", "experts_gate") > 0 and moved("layers", 2, "mlp", "experts_down") > 0
    assert moved("layers", 1, "attn", "q_proj") > 0
    assert moved("embedding") == moved("layers", 0, "mlp", "router") == moved("layers", 1, "mlp", "up_proj") == 0
    steps = [m for m in map(json.loads, open(os.path.join(c.run_dir, "metrics.jsonl"))) if "train/loss" in m]
    assert len(steps) == 2
