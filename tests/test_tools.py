"""The user-facing commands around a run: evaluate's pass@k, export to HF, report plots, the SFT warm start."""
import itertools
import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from areal_jax.evaluation.scoring import pass_at_k
from areal_jax.testing.tiny import tiny_config


@pytest.mark.parametrize("n,c,k", [(8, 0, 1), (8, 3, 1), (8, 3, 4), (5, 5, 2), (6, 1, 6), (7, 2, 3)])
def test_pass_at_k_matches_enumeration(n, c, k):
    """Share of k-subsets of n samples (c correct) holding at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    expected = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from areal_jax.system.job import RLJob

    directory = str(tmp_path_factory.mktemp("tools"))
    c = tiny_config(directory, eta=1, steps=2)
    job = RLJob(c, log_fn=lambda *a, **k: None)
    try:
        job.run()
        final = jax.tree.map(np.asarray, job.trainer.params)
    finally:
        job.close()
    return c, final


@pytest.mark.slow
def test_export_writes_the_trained_policy_as_an_hf_directory(tiny_run, tmp_path):
    from flax import nnx

    from areal_jax.models import load_hf_checkpoint
    from areal_jax.programs.export import export_policy
    from areal_jax.tokenizer import Tokenizer

    c, final = tiny_run
    out = export_policy(c.run_dir, str(tmp_path / "export"))
    model = load_hf_checkpoint(out)
    for got, want in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(final)):
        np.testing.assert_array_equal(np.asarray(got), want)
    tok = Tokenizer.from_pretrained(out)
    assert tok.eos_token_id is not None
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    tokens = np.array([[1, 5, 9, 13, 2, 7]], np.int32)
    with torch.no_grad():
        hf_logits = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits, atol=1e-4)


@pytest.mark.slow
def test_report_draws_pngs_from_a_run(tiny_run):
    from areal_jax.programs.report import busy_fractions, make_report, read_spans

    c, _ = tiny_run
    paths = make_report(c.run_dir)
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    spans = read_spans(c.run_dir)
    assert {"trainer", "sampler", "rewards"} <= set(spans)  # train steps, decode steps, reward work
    names = {n for v in spans.values() for _, _, n in v}
    assert {"train_step", "decode_step", "weight_update", "reward", "publish"} <= names
    fractions = busy_fractions(spans)
    assert all(0.0 <= v <= 1.0 for v in fractions.values())


@pytest.mark.slow
def test_sft_trains_and_saves_a_loadable_warm_start(tmp_path):
    from areal_jax.models import load_hf_checkpoint
    from areal_jax.programs.sft import run

    c = ml_collections.ConfigDict()
    c.out_dir, c.seed, c.batch_size, c.seq_len, c.max_new_tokens = str(tmp_path / "sft"), 0, 16, 72, 8
    c.eval_n, c.eval_slots = 8, 8
    c.data = ml_collections.ConfigDict(dict(n_train=100, n_test=20, seed=0, difficulty="easy"))
    c.model = ml_collections.ConfigDict(dict(architecture="qwen2", hidden_size=32, intermediate_size=64,
                                             num_layers=1, num_heads=2, num_kv_heads=1,
                                             max_position_embeddings=128))
    c.stages = [ml_collections.ConfigDict(dict(name="worked", mix={"worked": 1.0}, lr=3e-3, warmup_steps=1,
                                               max_steps=30, max_minutes=5.0, eval_every=30, stop_above=None,
                                               stop_below=None))]
    summary = run(c)
    assert summary["stages"][-1]["loss"] < 3.0  # well below log(62) = 4.1 of a uniform guess
    model = load_hf_checkpoint(c.out_dir)
    assert model.cfg.vocab_size == 62
    for name in ("train.jsonl", "test.jsonl"):
        assert os.path.exists(os.path.join(c.out_dir, "data", name))
    with open(os.path.join(c.out_dir, "sft_summary.json")) as f:
        assert "final" in json.load(f)


@pytest.mark.slow
def test_evaluating_a_run_directory_equals_evaluating_its_export(tiny_run, tmp_path):
    """--run_dir restores the run's latest checkpoint and evaluates it with the run's own settings: the same
    completions and rewards as the exported HF directory evaluated with those settings given as flags."""
    from areal_jax.config import from_config_dict
    from areal_jax.programs.evaluate import evaluate, resolve_settings
    from areal_jax.programs.export import export_policy

    c, _ = tiny_run
    run_out, model_out = str(tmp_path / "run.jsonl"), str(tmp_path / "model.jsonl")
    given = {"n": 12, "k": 2, "max_new_tokens": 24}
    config = from_config_dict(c)
    res = evaluate(resolve_settings(config, given, run_dir=c.run_dir, out=run_out), log=lambda *_: None)
    exported = export_policy(c.run_dir, str(tmp_path / "export"))
    flags = {**given, "model": exported, "data": c.data.test_path, "reward_fn": c.reward.fn}
    ref = evaluate(resolve_settings(config, flags, out=model_out),
                   log=lambda *_: None)
    assert open(run_out).read() == open(model_out).read()
    assert res["model"].endswith("(step 2)") and res["greedy_pass@1"] == ref["greedy_pass@1"]
    with pytest.raises(FileNotFoundError, match="no checkpoint of step 7"):
        evaluate(resolve_settings(config, given, run_dir=c.run_dir, step=7), log=lambda *_: None)
