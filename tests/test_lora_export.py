"""LoRA export and resume: PEFT directory round trip (and peft's logits when installed), merged HF export
(transformers' logits when installed), checkpoint restore of adapters and their AdamW state bit-exactly,
and `python -m areal_jax.programs.export` on a LoRA run."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.checkpoint import Checkpointer
from areal_jax.models import load_hf_checkpoint, lora
from areal_jax.models.peft_io import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter, peft_tensors, save_peft_adapter
from areal_jax.testing.models import tiny_config, write_random_hf_checkpoint
from areal_jax.testing.trajectories import random_trajectories
from areal_jax.trainer import Trainer, TrainerConfig

TOKENS = np.array([[1, 5, 9, 13, 2, 7, 40, 3], [4, 4, 60, 11, 90, 8, 1, 2]], np.int32)


def adapted_checkpoint(tmp_path, arch="qwen2", targets="all", seed=0):
    """An HF base directory and our adapted model over it with random (non-zero) B."""
    base_dir = str(tmp_path / f"base_{arch}")
    write_random_hf_checkpoint(base_dir, tiny_config(arch), seed=seed)
    model = load_hf_checkpoint(base_dir)
    lcfg = lora.LoRAConfig(rank=4, alpha=12.0, targets=targets)
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(seed + 1))
    for i, (_, node) in enumerate(nnx.iter_graph(model)):
        if isinstance(node, lora.LoRAProjection):
            node.lora_b.set_value(0.2 * jax.random.normal(jax.random.key(node.salt), node.lora_b.shape))
        elif isinstance(node, lora.LoRAExperts):
            node.lora_b.set_value(0.2 * jax.random.normal(jax.random.key(1000 + i), node.lora_b.shape))
    return base_dir, model, lcfg


def test_peft_directory_round_trip(tmp_path):
    base_dir, model, lcfg = adapted_checkpoint(tmp_path, targets="q,v,re:layers\\.1\\.mlp\\..*")
    out = save_peft_adapter(model, lcfg, tmp_path / "adapter", base_model_name_or_path=base_dir)
    with open(os.path.join(out, CONFIG_FILE)) as fh:
        config = json.load(fh)
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 12.0
    assert "model.layers.1.mlp.down_proj" in config["target_modules"]
    assert "model.layers.0.mlp.down_proj" not in config["target_modules"]
    tensors = peft_tensors(model)
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)  # [r, in]
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 4)  # [out, r]
    assert os.path.exists(os.path.join(out, WEIGHTS_FILE))
    fresh = load_hf_checkpoint(base_dir)
    lora.apply_lora(fresh, lcfg, rngs=nnx.Rngs(99))
    load_peft_adapter(fresh, out)
    for x, y in zip(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)), jax.tree.leaves(nnx.state(fresh, nnx.LoRAParam))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("arch,targets", [("qwen2", "all"), ("llama", "all"), ("gemma3", "all"), ("olmo3", "all"),
                                          ("phi3", "all"), ("phi3", "q,v,re:layers\\.1\\.mlp\\.up_proj"),
                                          ("qwen3_moe", "all"), ("granitemoe", "all"),
                                          ("qwen3_moe", "attn,experts"), ("granitemoe", "experts"), ("granitemoeshared", "attn,shared,experts"),
                                          ("mixtral", "q,re:layers\\.1\\.mlp\\.experts_(up|down)"), ("phimoe", "attn,experts"), ("flex_olmo", "attn,experts"),
                                          ("olmoe", "re:layers\\.0\\.mlp\\.experts_gate"),
                                          ("qwen2_moe", "experts"), ("qwen2_moe", "attn,shared"),
                                          ("qwen3_5_moe_text", "shared,experts"), ("deepseek_v3", "attn,experts"), ("gpt_oss", "attn,experts"),
                                          ("gpt_oss", "re:layers\\.1\\.mlp\\.experts_(gate|down)"),
                                          ("deepseek_v3", "q_b,kv_a,re:layers\\.1\\.mlp\\.experts_down"),
                                          ("glm4_moe", "attn,experts"), ("glm4_moe_lite", "attn,experts"),
                                          ("minimax_m2", "attn,experts"), ("ernie4_5", "all"), ("glm4", "all"),
                                          ("ernie4_5_moe", "attn,experts"), ("exaone4", "all"),
                                          ("exaone_moe", "attn,experts"), ("hunyuan_v1_moe", "attn,experts"),
                                          ("hunyuan_v1_dense", "all"), ("seed_oss", "all"),
                                          ("arcee", "all"), ("qwen3_5_text", "all"), ("ministral3", "all"),
                                          ("qwen3_5_text", "in_proj_qkv,out,re:layers\\.3\\.attn\\.q_proj"),
                                          ("qwen3_5_moe_text", "attn,experts"), ("qwen3_next", "attn,experts"),
                                          ("qwen3_next", "in_z,in_b,out"), ("lfm2", "all"), ("lfm2", "in,o"),
                                          ("lfm2_moe", "all"), ("lfm2_moe", "attn,experts"), ("lfm3", "all"),
                                          ("olmo_hybrid", "all"), ("olmo_hybrid", "in_v,in_b,o"), ("granitemoehybrid", "all"),
                                          ("granitemoehybrid", "q,up"), ("bamba", "all"),
                                          ("bamba", "in_xbc,in_dt,re:layers\\.1\\.attn\\.q_proj"),
                                          ("nemotron_h", "q,k,v,o,in_z,in_xbc,in_dt,up,down"), ("nemotron_h", "in_xbc,up")])
def test_peft_loads_our_adapters_with_equal_logits(tmp_path, arch, targets):
    """peft applies our adapters to the HF model with our logits; Phi's fused qkv_proj / gate_up_proj take the
    adapted parts' adapters side by side (all of them, or some: q and v of qkv, up of gate_up in one layer; Qwen3-Next's
    in_proj_qkvz / in_proj_ba with the parts' rows interleaved key head by key head, all or one of each), as do
    the experts' stacked gate_up_proj / down_proj through target_parameters (all, up and down of one layer, gate
    alone); reading the directory back gives the same adapters."""
    torch = pytest.importorskip("torch", reason="the PEFT round trip needs PyTorch")
    transformers = pytest.importorskip("transformers", reason="the PEFT round trip needs transformers")
    peft = pytest.importorskip("peft", reason="the PEFT round trip needs peft (pip install peft)")
    base_dir, model, lcfg = adapted_checkpoint(tmp_path, arch=arch, targets=targets)
    out = save_peft_adapter(model, lcfg, tmp_path / "adapter", base_model_name_or_path=base_dir)
    def peft_logits(dtype):
        hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype, experts_implementation=(
            "eager" if dtype == torch.float64 else None))  # the grouped matmul takes no float64
        with torch.no_grad():
            base = hf(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
            peft_model = peft.PeftModel.from_pretrained(hf, out)
            peft_model.eval()
            return base, peft_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()

    base_logits, got = peft_logits(torch.float32)
    want = np.asarray(model(jnp.asarray(TOKENS)))
    assert np.abs(want - base_logits).max() > 1e-2  # the adapters matter
    if not np.allclose(got, want, atol=1e-4, rtol=0):
        # Where float32 is ill-conditioned (Qwen3.5-MoE's random model: one token's linear attention puts both float32
        # results 4e-5 to 9e-5 off float64), ours must be as close to HF's float64 logits as HF's float32 ones are.
        exact = peft_logits(torch.float64)[1]
        ours, theirs = np.abs(want - exact).max(), np.abs(got - exact).max()
        assert ours <= max(1e-4, 3 * theirs), f"ours {ours:.2e} off HF's float64 logits, HF's float32 {theirs:.2e}"
    fresh = load_hf_checkpoint(base_dir)
    lora.apply_lora(fresh, lcfg, rngs=nnx.Rngs(99))
    load_peft_adapter(fresh, out)
    for x, y in zip(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)), jax.tree.leaves(nnx.state(fresh, nnx.LoRAParam))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_gated_deltanet_targets_adapt_only_its_layers_and_refuse_elsewhere(tmp_path):
    """Qwen3.5's Gated DeltaNet layers take adapters on their five projections (HF's names too) and its attention
    layers on q/k/v/o; a model without such layers refuses their names; the adapter bytes count what is built."""
    base_dir, model, lcfg = adapted_checkpoint(tmp_path, arch="qwen3_5_text", targets="all")
    linear = lora.linear_layers(model.cfg)
    assert linear and len(linear) < model.cfg.num_layers
    adapted = {(i, short) for i, short in lora.LoRAConfig(targets="all").target_paths(
        model.cfg.num_layers, (), lora.attention_projections(model.cfg), lora.mlp_projections(model.cfg), linear)}
    for i in range(model.cfg.num_layers):
        mixer = set(lora.LINEAR) if i in linear else {"q", "k", "v", "o"}
        assert {s for j, s in adapted if j == i} == mixer | {"gate", "up", "down"}
        if i in linear:
            assert isinstance(model.layers[i].linear_attn.in_proj_qkv, lora.LoRAProjection)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert lora.adapter_bytes(model.cfg, lcfg) == 4 * n
    tensors = peft_tensors(model)
    assert f"base_model.model.model.layers.{linear[0]}.linear_attn.in_proj_qkv.lora_A.weight" in tensors
    # the merged weights give the adapted model's logits (the Gated DeltaNet's adapters folded in like the rest)
    np.testing.assert_allclose(np.asarray(lora.merged_model(model, lcfg.scale)(jnp.asarray(TOKENS))),
                               np.asarray(model(jnp.asarray(TOKENS))), atol=2e-5, rtol=0)
    plain = write_random_hf_checkpoint(str(tmp_path / "qwen2"), tiny_config("qwen2"))
    with pytest.raises(ValueError, match="names in_qkv, out, the projections of Gated DeltaNet or LFM2 conv layers, "
                                         "which this model does not have"):
        lora.apply_lora(plain, lora.LoRAConfig(targets="q,in_proj_qkv,out_proj"), rngs=nnx.Rngs(0))


def test_peft_refuses_dense_mlp_adapters_where_peft_reads_them_as_experts(tmp_path):
    """PEFT maps every target ending in gate_proj / up_proj / down_proj of a DeepSeek-V3 (or Qwen3-MoE, OLMoE) model
    onto the stacked experts, so adapters of a dense layer's MLP would load as something else: refused by name."""
    for arch in ("glm4_moe", "ernie4_5_moe", "exaone_moe", "deepseek_v3"):  # measured: such adapters moved peft's
        # logits by 2.9 (GLM-4.5) and 1.9 (ERNIE 4.5); DeepSeek-V3 last, its directory read below
        base_dir, model, lcfg = adapted_checkpoint(tmp_path / arch, arch=arch, targets="all")
        with pytest.raises(ValueError, match="layers.0.mlp.down_proj, layers.0.mlp.gate_proj, layers.0.mlp.up_proj"):
            save_peft_adapter(model, lcfg, tmp_path / arch / "adapter")
    with pytest.raises(ValueError, match="names k, v, which this model's attention does not have; its projections "
                                         "are q_a, q_b, kv_a, kv_b, o"):
        lora.apply_lora(load_hf_checkpoint(base_dir), lora.LoRAConfig(targets="q_a,k,v"), rngs=nnx.Rngs(0))


def test_merged_export_loads_in_transformers_with_equal_logits(tmp_path):
    from areal_jax.models import save_hf_checkpoint

    _, model, lcfg = adapted_checkpoint(tmp_path, arch="qwen3")
    merged_dir = str(tmp_path / "merged")
    save_hf_checkpoint(lora.merged_model(model, lcfg.scale), merged_dir)
    want = np.asarray(model(jnp.asarray(TOKENS)))
    ours = load_hf_checkpoint(merged_dir)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(TOKENS))), want, atol=1e-4, rtol=0)
    torch = pytest.importorskip("torch", reason="the transformers check needs PyTorch")
    transformers = pytest.importorskip("transformers", reason="the transformers check needs transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        got = hf(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_checkpoint_restores_adapters_and_moments_bit_exactly(tmp_path):
    from areal_jax.runtime.mesh import MeshConfig, build_meshes

    mesh = build_meshes(MeshConfig(colocated=True, fsdp=2, tensor=2)).train_mesh
    base_dir, _, _ = adapted_checkpoint(tmp_path)
    lcfg = lora.LoRAConfig(rank=4, alpha=8.0, base_dtype="bfloat16")
    cfg = TrainerConfig(lr=1e-2, micro_batch_tokens=64, logits_chunk=16)

    def trainer():
        model = load_hf_checkpoint(base_dir)
        lora.apply_lora(model, lcfg, rngs=nnx.Rngs(7))
        return Trainer(model, cfg, mesh, wrt=nnx.LoRAParam)

    first = trainer()
    first.update(random_trajectories(6, vocab=97, seed=1))
    first.update(random_trajectories(6, vocab=97, seed=2))
    ckpt = Checkpointer(str(tmp_path / "run"))
    # The trainer's checkpoint meta (its book of compiled shapes) beside its state, so the resumed trainer packs alike.
    ckpt.save(first.version, first.state, {"version": first.version, **first.checkpoint_meta()})
    saved = jax.device_get(first.state)
    # What is saved: adapters and their moments only (the frozen base stays with the model directory).
    assert all(p[-1] in ("lora_a", "lora_b") for p, _ in nnx.to_flat_state(first.state.params))
    second = trainer()
    state, meta = ckpt.restore(ckpt.latest_step(), second.state)
    second.restore(state, meta)
    assert second.layouts.state() == first.layouts.state() and first.layouts.compiled
    ckpt.close()
    assert meta["version"] == 2 and second.version == 2
    for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(second.state))):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Both continue identically.
    trajs = random_trajectories(6, vocab=97, seed=3)
    m1, m2 = first.update(trajs), second.update(trajs)
    assert m1["loss"] == m2["loss"]
    for x, y in zip(jax.tree.leaves(jax.device_get(first.params)), jax.tree.leaves(jax.device_get(second.params))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_export_command_writes_merged_and_peft_directories_of_a_lora_run(tmp_path):
    from areal_jax.programs.export import export_policy
    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config as tiny_run_config

    c = tiny_run_config(str(tmp_path), eta=1, steps=2)
    c.lora.enabled = True
    c.lora.rank = 4
    c.lora.targets = "attn,up"
    job = RLJob(c, log_fn=lambda *a, **k: None)
    try:
        job.run()
        trained = jax.device_get(job.trainer.params)
        graphdef = job.trainer.graphdef
        sent = job.channel.last_bytes
    finally:
        job.close()
    adapters = nnx.filter_state(trained, nnx.LoRAParam)
    assert sent == sum(x.nbytes for x in jax.tree.leaves(adapters))  # the hand-off moved the adapters only
    assert max(np.abs(np.asarray(x)).max() for x in jax.tree.leaves(adapters)) > 0
    policy = nnx.merge(graphdef, trained)
    lora.set_dropout(policy, False)
    want = np.asarray(policy(jnp.asarray(TOKENS % 40)))
    merged = load_hf_checkpoint(export_policy(c.run_dir, str(tmp_path / "merged")))
    np.testing.assert_allclose(np.asarray(merged(jnp.asarray(TOKENS % 40))), want, atol=1e-4, rtol=0)
    peft_dir = export_policy(c.run_dir, str(tmp_path / "peft"), fmt="peft")
    fresh = load_hf_checkpoint(c.model.path)
    lora.apply_lora(fresh, lora.LoRAConfig(rank=4, alpha=c.lora.alpha, targets="attn,up"), rngs=nnx.Rngs(0))
    load_peft_adapter(fresh, peft_dir)
    np.testing.assert_allclose(np.asarray(fresh(jnp.asarray(TOKENS % 40))), want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="--format"):
        export_policy(c.run_dir, str(tmp_path / "x"), fmt="onnx")


@pytest.mark.parametrize("arch", ["deepseek_v3", "hunyuan_v1_moe"])
def test_shared_expert_adapters_train_merge_and_refuse_a_peft_export_peft_would_misread(tmp_path, arch):
    """A shared expert's gate / up / down take adapters (lora.targets "shared"): the adapted model's logits equal its
    merged weights' and differ from the base's; their bytes are counted. Where PEFT reads a dense MLP's gate_proj as
    the experts' (DeepSeek's, Hunyuan MoE's: peft's logits were 1.6 / 2.5 off with them written), the PEFT export
    refuses them by name (the merged export takes them); Qwen2-MoE's and Qwen3.5-MoE's load (the parity test above)."""
    base_dir, model, lcfg = adapted_checkpoint(tmp_path, arch=arch, targets="attn,shared")
    shared = [(i, s) for i, s in lora.model_targets(model.cfg, lcfg) if s in lora.SHARED]
    assert shared and {i for i, _ in shared} == set(lora.expert_layers(model.cfg))
    assert isinstance(model.layers[shared[0][0]].mlp.shared_expert.gate_proj, lora.LoRAProjection)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    assert lora.adapter_bytes(model.cfg, lcfg) == 4 * n
    merged = lora.merged_model(model, lcfg.scale)
    np.testing.assert_allclose(np.asarray(merged(jnp.asarray(TOKENS))), np.asarray(model(jnp.asarray(TOKENS))),
                               atol=2e-5, rtol=0)
    assert np.abs(np.asarray(model(jnp.asarray(TOKENS))) - np.asarray(load_hf_checkpoint(base_dir)(
        jnp.asarray(TOKENS)))).max() > 1e-2
    with pytest.raises(ValueError, match=r"mlp\.shared_expert\.gate_proj.*export the merged checkpoint"):
        save_peft_adapter(model, lcfg, tmp_path / "adapter", base_model_name_or_path=base_dir)
