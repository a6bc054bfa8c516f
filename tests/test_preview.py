"""`python -m areal_jax.programs.preview`: a job's data read as the job reads it, its figures against a direct
count, the prompts shown as the model reads them, a mixture's shares, and its errors."""
import json
import os
import subprocess
import sys

import numpy as np

from areal_jax import config as config_lib
from areal_jax.data.code_synthetic import write_splits as write_code_splits
from areal_jax.data.pipeline import load_prompt_source
from areal_jax.programs.preview import preview
from areal_jax.testing.tiny import tiny_config
from areal_jax.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_figures_and_prompts_are_those_the_job_reads(tmp_path):
    c = tiny_config(str(tmp_path))
    other = tmp_path / "other.jsonl"
    rows = open(c.data.train_path).read().splitlines()
    other.write_text("\n".join(rows[:30] + ["{not json"]) + "\n")
    c.data.train_path, c.data.train_weights = f"main={c.data.train_path},other={other}", "3,1"
    c.data.on_bad_row, c.data.max_prompt_len = "skip", 34
    c.rollout.max_new_tokens, c.rollout.max_len = 8, 48
    c.eval.n_test = 5
    job = config_lib.validate(c)
    lines = []
    res = preview(job, n=1, log=lines.append)
    tok = Tokenizer.from_pretrained(job.model.path)
    for entry, path in zip(res["train"], (tiny_config(str(tmp_path), write=False).data.train_path, str(other))):
        source = load_prompt_source(path, tok, max_prompt_len=34, on_bad_row="skip")  # the job's own reading
        lengths = [len(i.prompt_tokens) for i in source.items]
        assert entry["prompts"] == len(lengths) and entry["too_long_skipped"] == source.num_too_long_skipped
        assert entry["prompt_tokens"] == {"min": min(lengths), "median": float(np.median(lengths)),
                                          "p95": float(np.percentile(lengths, 95)), "max": max(lengths)}
        assert 0 < entry["too_long_skipped"] and entry["prompt_tokens"]["max"] <= 34
    assert [e["share"] for e in res["train"]] == [0.75, 0.25] and res["train"][1]["malformed_skipped"] == 1
    assert res["test"][0]["evaluated"] == 5
    first = load_prompt_source(str(other), tok, max_prompt_len=34, on_bad_row="skip").items[0]
    shown = lines.index(f"  --- {first.key} ({len(first.prompt_tokens)} tokens):")
    assert lines[shown + 1] == "  " + tok.decode(list(first.prompt_tokens)).replace("\n", "\n  ")
    assert lines[shown + 2] == f"  --- answer: {first.answer}"
    assert any(line.startswith("train other (") and "25% of draws" in line and "skipped 1 malformed rows" in line
               for line in lines)


def test_a_code_tasks_tests_are_counted_not_printed(tmp_path):
    from areal_jax.data.code_tokenizer import build_code_tokenizer

    c = tiny_config(str(tmp_path))
    build_code_tokenizer().save_pretrained(str(tmp_path / "code_tok"))
    code = write_code_splits(str(tmp_path / "code"), 6, 2, seed=0)
    c.model.tokenizer_path = str(tmp_path / "code_tok")
    c.data.task, c.data.train_path, c.data.max_prompt_len = "code", code["train"], 96
    c.rollout.max_len, c.train.micro_batch_tokens = 120, 256
    c.reward.fn, c.reward.timeout_s = "code", 30.0
    lines = []
    preview(config_lib.validate(c), n=1, log=lines.append)
    answers = [line for line in lines if line.startswith("  --- answer:")]
    assert answers == ["  --- answer: hidden tests: 5 call cases"]  # the row's five asserts, as calls


def test_the_command_line_prints_one_json_line_or_a_config_error(tmp_path):
    cmd = [sys.executable, "-m", "areal_jax.programs.preview", "--config=configs/math.py", "--n=1",
           "--config.eval.n_test=7"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["train"][0]["task"] == "math" and res["test"][0]["evaluated"] == 7
    assert "Question:" in r.stdout
    cmd = [sys.executable, "-m", "areal_jax.programs.preview", "--config=configs/math.py",
           "--config.data.train_path=/nowhere.jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "Config error: --config.data.train_path='/nowhere.jsonl' does not exist." in r.stderr
