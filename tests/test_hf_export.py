"""HF directories written during a run (checkpoint.hf_every_steps): complete, a snapshot of the step, pruned,
failures contained, and the job's last step exported."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.checkpoint import CheckpointConfig
from areal_jax.models import load_hf_checkpoint
from areal_jax.system import hf_export
from areal_jax.system.hf_export import HFExporter
from areal_jax.testing.models import random_model, tiny_config

TOKENS = np.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]], np.int32)


class Tok:
    """A tokenizer stand-in: writes one file, or fails when asked to."""

    fail = False

    def save_pretrained(self, directory):
        if self.fail:
            raise OSError("disk full")
        with open(os.path.join(directory, "tokenizer.json"), "w") as fh:
            fh.write("{}")


def params_of(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_each_directory_is_the_step_it_was_taken_at_and_old_ones_are_pruned(tmp_path):
    lines = []
    exporter = HFExporter(tmp_path, Tok(), CheckpointConfig(hf_every_steps=2, hf_keep=2), log=lines.append)
    assert [s for s in range(1, 8) if exporter.due(s)] == [2, 4, 6]
    model = random_model(tiny_config("qwen3"), seed=0)
    saved = {}
    for step in (2, 4, 6):
        exporter.export(model, step)
        saved[step] = params_of(model)
        # the next update lands while the directory is still being written: the export keeps the step's weights
        nnx.update(model, jax.tree.map(lambda x: x + 1.0, nnx.state(model, nnx.Param)))
    exporter.close()
    assert sorted(os.listdir(tmp_path / "hf")) == ["step_4", "step_6"]  # hf_keep=2: step_2 deleted
    for step in (4, 6):
        loaded = load_hf_checkpoint(tmp_path / "hf" / f"step_{step}")
        for a, b in zip(params_of(loaded), saved[step]):
            np.testing.assert_array_equal(a, b)
        assert os.path.isfile(tmp_path / "hf" / f"step_{step}" / "tokenizer.json")
    assert exporter.written == [2, 4, 6] and exporter.failures == 0
    assert any("HF export of step 6" in line and "MiB" in line for line in lines)
    assert exporter.due(7, final=True) and not exporter.due(6, final=True)  # the last step, unless just exported


def test_bfloat16_directories_and_a_failed_write_costs_that_export_only(tmp_path):
    lines, tok = [], Tok()
    exporter = HFExporter(tmp_path, tok, CheckpointConfig(hf_every_steps=1, hf_dtype="bfloat16"), log=lines.append)
    model = random_model(tiny_config("llama"), seed=1)
    tok.fail = True
    exporter.export(model, 1)
    exporter.wait()
    assert exporter.failures == 1 and "disk full" in lines[-1] and "training goes on" in lines[-1]
    assert not os.path.exists(tmp_path / "hf" / "step_1")  # never a half-written step directory
    tok.fail = False
    exporter.export(model, 2)
    exporter.close()
    loaded = load_hf_checkpoint(tmp_path / "hf" / "step_2", param_dtype=jnp.bfloat16)
    for a, b in zip(params_of(loaded), params_of(model)):
        np.testing.assert_array_equal(a, np.asarray(jnp.asarray(b, jnp.bfloat16)))
    assert sorted(os.listdir(tmp_path / "hf")) == ["step_2"]  # the failed attempt left nothing behind


def test_short_host_memory_writes_while_the_trainer_waits(tmp_path, monkeypatch):
    lines = []
    monkeypatch.setattr(hf_export, "available_host_bytes", lambda: 1024)
    exporter = HFExporter(tmp_path, Tok(), CheckpointConfig(hf_every_steps=3), log=lines.append)
    model = random_model(tiny_config("qwen2"), seed=2)
    exporter.export(model, 3)
    assert exporter._thread is None and exporter.blocking == 1  # written before export returned
    assert "writing while the trainer waits" in lines[0]
    loaded = load_hf_checkpoint(tmp_path / "hf" / "step_3")
    np.testing.assert_array_equal(np.asarray(loaded(jnp.asarray(TOKENS))), np.asarray(model(jnp.asarray(TOKENS))))
    exporter.close()


def test_a_job_exports_every_nth_step_and_its_last(tmp_path):
    """A 3-step run with hf_every_steps=2: hf/step_2 and hf/step_3, the last holding the trainer's final policy
    and the run's tokenizer; transformers loads it with the same logits when installed."""
    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config as tiny_run_config

    c = tiny_run_config(str(tmp_path), eta=1, steps=3)
    c.checkpoint.hf_every_steps = 2
    c.eval.at_start = c.eval.at_end = False
    lines = []
    job = RLJob(c, log_fn=lambda *a, **k: lines.append(" ".join(map(str, a))))
    try:
        job.run()
        policy = nnx.merge(job.graphdef, jax.device_get(job.trainer.params))
    finally:
        job.close()
    out = os.path.join(c.run_dir, "hf")
    assert sorted(os.listdir(out)) == ["step_2", "step_3"]
    final = os.path.join(out, "step_3")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(final))
    want = np.asarray(policy(jnp.asarray(TOKENS % 40)))
    np.testing.assert_array_equal(np.asarray(load_hf_checkpoint(final)(jnp.asarray(TOKENS % 40))), want)
    assert any("HF export of step 3" in line for line in lines)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(torch.tensor(TOKENS % 40, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(final).encode("1+2=3")
