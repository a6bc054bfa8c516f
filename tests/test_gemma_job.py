"""A whole run on a Gemma-3-form model (sliding and global layers, their own RoPE bases, offset norms), a Gemma 2 one
(soft caps), a Phi one (partial rotary embeddings, LongRoPE's long factors chosen by the run's max_len) and a
Qwen3-MoE one (experts in two layers of three, a dense MLP between; with rollout routing replay) and a gpt-oss one
(attention sinks, every other layer sliding, experts with biases and the clamped GLU) and a DeepSeek-V3 one (latent
attention, a dense layer then experts picked by sigmoid scores within groups, with rollout routing replay), an
EXAONE 4.0 one (norms after attention and MLP only, the global layer without RoPE), an Arcee one (an MLP without
gate) and a Qwen3.5 one (Gated DeltaNet layers around one of gated attention; the paged cache): the
memory plan's probes, the sampler, the trainer, the hand-off and the HF export all take it, and every behaviour
log-prob the sampler recorded equals a full forward of the policy version that generated it (and for the
mixture of experts, every route it recorded the experts that forward picks)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.data.math_tokenizer import build_math_tokenizer
from areal_jax.models import load_hf_checkpoint
from areal_jax.system.job import RLJob
from areal_jax.testing.models import tiny_config as tiny_model_config
from areal_jax.testing.models import write_random_hf_checkpoint
from areal_jax.testing.tiny import tiny_config


# qwen3_5_text is long (40-55 s in CI): tests/test_qwen3_5.py runs its sampler, dense and over pages, against full forwards
@pytest.mark.parametrize("arch", ["gemma3", pytest.param("gemma2", marks=pytest.mark.long),  # 14 s: gemma3's windows
                                  "phi3", "qwen3_moe", "arcee",
                                  pytest.param("exaone4", marks=pytest.mark.long),  # 22 s; its layers: test_exaone*.py
                                  pytest.param("lfm3", marks=pytest.mark.long),  # 24 s; its layers: test_lfm2.py
                                  # 16 s; its sinks and clamped GLU in tests/test_gpt_oss.py, qwen3_moe's run has experts
                                  pytest.param("gpt_oss", marks=pytest.mark.long),
                                  pytest.param("phimoe", marks=pytest.mark.long),  # 18 s; its routing and untied head: tests/test_phimoe.py
                                  pytest.param("lfm2", marks=pytest.mark.long),  # 25 s; the conv layers: tests/test_lfm2.py
                                  pytest.param("lfm2_moe", marks=pytest.mark.long),  # 36 s
                                  pytest.param("olmo_hybrid", marks=pytest.mark.long),
                                  pytest.param("granitemoehybrid", marks=pytest.mark.long),  # Granite 4.0's Mamba-2
                                  pytest.param("nemotron_h", marks=pytest.mark.long),  # a layer without an MLP
                                  pytest.param("falcon_h1", marks=pytest.mark.long),  # attention and Mamba-2 side by side
                                  pytest.param("jamba", marks=pytest.mark.long),  # Mamba mixers, experts
                                  pytest.param("falcon_mamba", marks=pytest.mark.long),  # no attention at all
                                  pytest.param("mamba2", marks=pytest.mark.long),  # nor here: Mamba-2 mixers alone
                                  pytest.param("nanochat", marks=pytest.mark.long),  # unscaled norms, capped logits
                                  pytest.param("cohere2", marks=pytest.mark.long),  # parallel blocks, NoPE full layers
                                  pytest.param("apertus", marks=pytest.mark.long),  # xIELU's scalars (0-d ones too)
                                  pytest.param("deepseek_v3", marks=pytest.mark.long),  # 25-31 s; its layers and
                                  # sampler in tests/test_deepseek.py, a whole MoE job in qwen3_moe's run here
                                  pytest.param("qwen3_5_text", marks=pytest.mark.long)])
def test_a_run_on_a_sliding_window_model(tmp_path, arch):
    tok = build_math_tokenizer()
    model_dir = str(tmp_path / arch)
    window = {"phi3": {}, "qwen3_moe": {"moe_layers": (1, 0, 1)}, "deepseek_v3": {}, "arcee": {}, "qwen3_5_text": {},
              "lfm2": {}, "lfm2_moe": {}, "lfm3": {"sliding_window": 6}, "olmo_hybrid": {}, "nemotron_h": {}, "falcon_h1": {},
              "jamba": {"num_experts": 4, "num_experts_per_tok": 2, "moe_layers": (0, 1, 0)}, "falcon_mamba": {}, "mamba2": {}, "nanochat": {}, "cohere2": {"sliding_window": 6}, "apertus": {},
              "granitemoehybrid": {"mamba": (4, 32, 16, 2, 4),
                                   "layer_types": ("linear_attention", "full_attention", "linear_attention")}}.get(
        arch, {"sliding_window": 6})
    cfg = tiny_model_config(arch, num_layers=3, vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, tie_word_embeddings=arch != "phimoe", **window)
    if arch in ("gemma3", "gemma2", "gpt_oss"):
        assert [cfg.layer_window(i) for i in range(3)] == [6, None, 6]
    write_random_hf_checkpoint(model_dir, cfg, seed=0)
    tok.save_pretrained(model_dir)
    c = tiny_config(str(tmp_path), eta=1, steps=2)
    c.model.path = model_dir
    c.rollout.max_new_tokens = 16  # completions run past the window
    c.checkpoint.hf_every_steps = 2
    if arch == "qwen3_moe":  # the experts through jax.lax.ragged_dot (the CPU's default is blocked)
        c.model.moe_impl = "ragged"
    if arch in ("qwen3_moe", "deepseek_v3"):  # the sampler records each sample's experts; the trainer replays them
        c.train.router_replay = "replay"
    if arch in ("qwen3_5_text", "lfm2", "lfm2_moe", "lfm3", "olmo_hybrid", "granitemoehybrid", "nemotron_h", "falcon_h1",
                "jamba", "falcon_mamba", "mamba2"):  # the stateful layers' rows beside the pages; a group shares its prompt's
        c.rollout.kv_cache, c.rollout.page_size = "paged", 4
    if arch == "deepseek_v3":  # auxiliary-loss-free balancing moves the picking bias after each optimizer step
        c.train.router_bias_rate = 0.01
    lines, trained = [], []
    job = RLJob(c, log_fn=lambda *a, **k: lines.append(" ".join(map(str, a))))
    update = job.trainer.update

    def recording(trajectories):  # what the trainer receives: the sampler's tokens, log-probs and versions
        trained.extend(trajectories)
        return update(trajectories)

    job.trainer.update = recording
    try:
        summary = job.run()
    finally:
        job.close()
    assert summary["steps"] == 2 and any("Device memory" in line for line in lines)
    assert job.model_config.moe_impl == ("ragged" if arch == "qwen3_moe" else "auto")
    assert trained and max(len(t.tokens) - t.prompt_len for t in trained) > 6
    # the behaviour log-probs of version-0 tokens equal a full forward of the starting checkpoint (Phi: with the
    # LongRoPE factors of the run's max_len, past its original_max_position_embeddings of 32)
    start = load_hf_checkpoint(model_dir, max_len=c.rollout.max_len)
    if arch == "phi3":
        assert c.rollout.max_len > 32 and start.cfg.rope_scaling["use_long_factor"]
    checked = 0
    for t in trained:
        if np.asarray(t.versions).max() != 0:
            continue
        seq, n = np.asarray(t.tokens, np.int32), t.prompt_len
        logp = jax.nn.log_softmax(start(jnp.asarray(seq[None]))[0], axis=-1)
        want = np.asarray(logp[n - 1:-1])[np.arange(len(seq) - n), seq[n:]]
        np.testing.assert_allclose(t.behav_logp, want, atol=2e-4)
        if arch in ("qwen3_moe", "deepseek_v3"):  # routes of every token (prompt too) of a sample run at version 0
            routes = start.hidden(jnp.asarray(seq[None]), record_routes=True)[1]["routes"][0]
            np.testing.assert_array_equal(np.sort(t.routes, -1), np.sort(np.asarray(routes), -1))
        checked += 1
    assert checked >= 2
    if arch in ("qwen3_moe", "deepseek_v3"):
        steps = [m for m in map(json.loads, open(os.path.join(c.run_dir, "metrics.jsonl"))) if "train/loss" in m]
        agreement = [m["train/moe_route_agreement"] for m in steps]
        assert len(agreement) == 2 and all(0.5 < a <= 1.0 for a in agreement), agreement
    exported = load_hf_checkpoint(os.path.join(c.run_dir, "hf", "step_2"))
    if arch == "deepseek_v3":  # each optimizer step moved each expert's bias by -0.01, 0 or +0.01
        steps = 2 * c.train.ppo_minibatches
        moved = np.asarray(exported.layers[1].mlp.router_score_bias[...]) - np.asarray(
            start.layers[1].mlp.router_score_bias[...])
        assert np.abs(moved).max() > 0.005 and np.abs(moved).max() <= 0.01 * steps + 1e-6
        np.testing.assert_allclose(moved * 100, np.round(moved * 100), atol=1e-4)
    assert exported.cfg.layer_types == cfg.layer_types and exported.cfg.sliding_window == window.get("sliding_window")
    assert exported.cfg.replace(dtype=cfg.dtype) == cfg.replace(eos_token_id=exported.cfg.eos_token_id)
