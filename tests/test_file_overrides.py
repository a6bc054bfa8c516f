"""data.file_overrides: one file of a run read its own way (field names, prompt template, length limit), on top of
data.task_overrides, in the training stream, the evaluation sets, the preview and the budget check; its errors."""
import contextlib
import json

import pytest

from areal_jax.config import ConfigError, JobConfig, validate
from areal_jax.data.math_tokenizer import build_math_tokenizer
from areal_jax.data.sources import files_as_read, load_train_prompts
from areal_jax.data.synthetic_math import write_splits
from areal_jax.evaluation.sets import load_eval_sets
from areal_jax.testing.tiny import tiny_config


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """gsm: question / answer rows; other: the same problems as problem / solution rows (another dataset's layout)."""
    gsm = write_splits(str(tmp_path_factory.mktemp("gsm")), n_train=12, n_test=4, seed=1)
    other_dir = tmp_path_factory.mktemp("other")
    out = {}
    for split in ("train", "test"):
        with open(gsm[split]) as fh:
            rows = [json.loads(line) for line in fh]
        out[split] = str(other_dir / f"{split}.jsonl")
        with open(out[split], "w") as fh:
            for r in rows:
                fh.write(json.dumps({"problem": r["question"], "solution": r["answer"]}) + "\n")
    return gsm, out


def _stream(data, tok):
    return load_train_prompts(data, tok, seed=0, process_index=0, process_count=1,
                              on_file=lambda path: contextlib.nullcontext())


def test_one_file_reads_with_its_own_fields_and_template(files):
    gsm, other = files
    tok = build_math_tokenizer()
    overrides = {"other": {"question_field": "problem", "answer_field": "solution",
                           "prompt_template": "{question}\nAnswer:"}}
    data = JobConfig().data.replace(train_path=f"gsm={gsm['train']},other={other['train']}",
                                    test_path=f"gsm={gsm['test']},other={other['test']}",
                                    file_overrides=json.dumps(overrides))
    seen = {"gsm": 0, "other": 0}
    for e in _stream(data, tok).take(24):
        text, name = tok.decode(e.prompt_tokens), e.uid.split(":")[0]
        seen[name] += 1
        if name == "other":
            assert not text.startswith("Question") and text.endswith("\nAnswer:") and e.answer
        else:
            assert text.startswith("Question: ") and text.endswith("\nAnswer:")
    assert seen["gsm"] and seen["other"]
    sets = load_eval_sets(data.test_path, tok, data, 4)
    uids = [e.uid for examples in sets.values() for e in examples]  # both files are test.jsonl: told apart by set
    assert len(set(uids)) == 8 and {u.split(":")[0] for u in uids} == {"gsm", "other"} and uids[0] == "gsm:1:0"
    assert not any(tok.decode(e.prompt_tokens).startswith("Question") for e in sets["other"])
    assert [tok.decode(e.prompt_tokens)[:10] for e in sets["gsm"]] == ["Question: "] * 4
    # the same problems under both layouts: the same answers
    assert sorted(e.answer for e in sets["other"]) == sorted(e.answer for e in sets["gsm"])
    # without the override, the other file has no question field
    bare = data.replace(file_overrides="")
    with pytest.raises(Exception, match="question"):
        _stream(bare, tok).take(1)


def test_file_overrides_stack_on_task_overrides_and_fail_early(files, tmp_path):
    gsm, other = files
    data = JobConfig().data.replace(train_path=f"gsm={gsm['train']},other={other['train']}",
                                    task_overrides=json.dumps({"math": {"max_prompt_len": 100}}),
                                    file_overrides=json.dumps({"other": {"question_field": "problem",
                                                                         "answer_field": "solution"}}))
    sections = dict(files_as_read(data))
    assert sections["data.file_overrides['other']"].max_prompt_len == 100  # the task's, under the file's own keys
    assert sections["data.file_overrides['other']"].question_field == "problem"
    c = tiny_config(str(tmp_path))
    c.data.train_path = f"gsm={gsm['train']},other={other['train']}"
    c.data.file_overrides = json.dumps({"other": {"question_field": "problem", "answer_field": "solution",
                                                  "max_prompt_len": 500}})
    with pytest.raises(ConfigError, match=r"data.file_overrides\['other'\].max_prompt_len \(500\) \+ rollout"):
        validate(c)
    c.data.file_overrides = json.dumps({"gsm8k": {"max_prompt_len": 10}})
    with pytest.raises(ConfigError, match="'gsm8k' is not a file name of data.train_path or data.test_path; each is "
                                          "one of gsm, other"):
        validate(c)
    c.data.file_overrides = json.dumps({"other": {"shuffle": False}})
    with pytest.raises(ConfigError, match="'shuffle' cannot differ per file"):
        validate(c)
    c.data.file_overrides = json.dumps({"other": {"max_prompt_len": 0}})
    with pytest.raises(ConfigError, match=r"file_overrides\['other'\].*max_prompt_len=0 must be at least 1"):
        validate(c)
