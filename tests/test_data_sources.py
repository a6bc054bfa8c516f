"""Training from several files (data.train_path = NAME=PATH,NAME=PATH, data.train_weights): the stream's shares
against the weights, each file's own epochs, process shards, resume, the one-file order kept, per-source metrics,
the config's errors, and a job that trains on a mixture."""
import contextlib
import json
import os
from collections import Counter

import numpy as np
import pytest

from areal_jax.config import ConfigError, JobConfig, validate
from areal_jax.data import make_prompt_iterator
from areal_jax.data.math_tokenizer import build_math_tokenizer
from areal_jax.data.prompts import PromptExample
from areal_jax.data.sources import load_train_prompts, parse_weights, source_names, source_summary
from areal_jax.data.synthetic_math import write_splits
from areal_jax.system.buffer import Group

SMALL, LARGE = 7, 31  # primes: epochs and shards do not line up


@pytest.fixture(scope="module")
def tok():
    return build_math_tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    small = write_splits(str(tmp_path_factory.mktemp("small")), n_train=SMALL, n_test=2, seed=1)["train"]
    large = write_splits(str(tmp_path_factory.mktemp("large")), n_train=LARGE, n_test=2, seed=2)["train"]
    return small, large  # both named train.jsonl, in two directories


def _data(train_path, weights="", **kw):
    return JobConfig().data.replace(train_path=train_path, train_weights=weights, **kw)


def _stream(data, tok, process_index=0, process_count=1, seed=0):
    return load_train_prompts(data, tok, seed=seed, process_index=process_index, process_count=process_count,
                              on_file=lambda path: contextlib.nullcontext())


def _uids(stream, n):
    return [e.uid for e in stream.take(n)]


def test_weights_set_each_files_share_and_each_file_keeps_its_own_epochs(files, tok):
    small, large = files
    stream = _stream(_data(f"s={small},l={large}", "1,3"), tok)
    uids = _uids(stream, 400)
    names = Counter(u.split(":")[0] for u in uids)
    assert names == {"s": 100, "l": 300}  # grain's mix is deterministic: each prefix keeps close to 1:3
    for prefix in (40, 123, 257):
        assert abs(sum(u.startswith("s:") for u in uids[:prefix]) - prefix / 4) <= 1
    for name, size in (("s", SMALL), ("l", LARGE)):
        mine = [u for u in uids if u.startswith(f"{name}:")]
        for i, uid in enumerate(mine):  # the n-th draw of a file belongs to its epoch n // size
            assert int(uid.rsplit(":", 1)[1]) == i // size
        for epoch in range(len(mine) // size):  # each whole epoch of a file has its every row once
            rows = [u.split(":")[1] for u in mine[epoch * size:(epoch + 1) * size]]
            assert sorted(map(int, rows)) == list(range(1, size + 1))
    # the small file is seen more often than its share of the rows (7 of 38), and each of its rows more often than a row of the other
    assert names["s"] / 400 > SMALL / (SMALL + LARGE) and (names["s"] / SMALL) / (names["l"] / LARGE) > 1.4


def test_without_weights_the_files_are_one_dataset(files, tok):
    small, large = files
    stream = _stream(_data(f"{small},big={large}"), tok)  # the bare path is named by its stem
    assert source_names(_data(f"{small},big={large}")) == ["train", "big"]
    first = _uids(stream, SMALL + LARGE)
    assert sorted(u.rsplit(":", 1)[0] for u in first) == sorted(
        [f"train:{r}" for r in range(1, SMALL + 1)] + [f"big:{r}" for r in range(1, LARGE + 1)])
    assert all(u.endswith(":0") for u in first) and all(u.endswith(":1") for u in _uids(stream, 5))


def test_one_file_streams_as_before(files, tok):
    small, _ = files
    old = make_prompt_iterator(small, tok, seed=5, process_index=0, process_count=1)
    new = _stream(_data(small), tok, seed=5)
    assert [e.uid for e in old.take(20)] == [e.uid for e in new.take(20)]
    assert new.take(1)[0].uid.startswith("train.jsonl:")  # one file: uids keep the file's name
    assert source_names(_data(small)) == []


def test_a_mixture_resumes_where_it_stopped_and_refuses_other_weights(files, tok):
    small, large = files
    data = _data(f"s={small},l={large}", "2,1")
    stream = _stream(data, tok, seed=3)
    stream.take(17)
    state = json.loads(json.dumps(stream.get_state()))
    expected = _uids(stream, 40)
    resumed = _stream(data, tok, seed=3)
    resumed.set_state(state)
    assert _uids(resumed, 40) == expected
    other = _stream(_data(f"s={small},l={large}", "1,1"), tok, seed=3)
    with pytest.raises(ValueError, match="different data stream.*weights"):
        other.set_state(state)


def test_processes_split_each_file_of_a_mixture(files, tok):
    small, large = files
    data = _data(f"s={small},l={large}", "1,1")
    shards = [_stream(data, tok, process_index=i, process_count=2) for i in range(2)]
    for name, size in (("s", SMALL), ("l", LARGE)):
        rows = [{u.rsplit(":", 1)[0] for u in _uids(_stream(data, tok, process_index=i, process_count=2), 4 * LARGE)
                 if u.startswith(f"{name}:")} for i in range(2)]
        assert not rows[0] & rows[1] and len(rows[0] | rows[1]) == size
    assert [s.shard_sizes for s in shards] == [[4, 16], [3, 15]]


def test_bad_weights_and_files_fail_in_the_config(files, tmp_path):
    small, large = files
    assert parse_weights("", 3) is None and parse_weights("1, 2.5", 2) == [1.0, 2.5]
    for value, needle in (("1,2,3", "gives 3 weight\\(s\\) for 2 file\\(s\\)"), ("1,x", "not a comma-separated"),
                          ("1,0", "every weight must be a positive number"), ("1,nan", "positive number")):
        with pytest.raises(ValueError, match=needle):
            parse_weights(value, 2)
    model = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "math_reasoner")
    c = JobConfig().replace(model=JobConfig().model.replace(path=model), eval=JobConfig().eval.replace(n_test=0))

    def check(train_path, weights=""):
        validate(c.replace(data=_data(train_path, weights)))

    check(f"s={small},l={large}", "1,3")
    with pytest.raises(ConfigError, match=r"--config.data.train_weights='1' gives 1 weight"):
        check(f"s={small},l={large}", "1")
    with pytest.raises(ConfigError, match="two files are named 'train'"):
        check(f"{small},{large}")
    with pytest.raises(ConfigError, match=r"--config.data.train_path: '/no.jsonl' \(the file named 'x'\) does not"):
        check(f"s={small},x=/no.jsonl")


def _group(uid, rewards):
    r = np.asarray(rewards, np.float32)
    return Group(gid=0, example=PromptExample(uid=uid, prompt_tokens=[1], answer="", question=""), admit_version=0, completions=[], rewards=r,
                 reward_status=["ok"] * len(r), advantages=np.zeros_like(r))


def test_source_metrics_worked_by_hand():
    groups = [_group("a:1:0", [1.0, 0.0]), _group("a:4:2", [1.0, 1.0]), _group("b:2:0", [0.5, 0.0])]
    got = source_summary(groups, ["a", "b", "c"])
    assert got == pytest.approx({"source/a/groups": 2.0, "source/a/reward": 0.75, "source/a/accuracy": 0.75,
                                 "source/b/groups": 1.0, "source/b/reward": 0.25, "source/b/accuracy": 0.0,
                                 "source/c/groups": 0.0})
    assert source_summary(groups, []) == {}


def test_a_job_trains_on_a_weighted_mixture_and_logs_each_source(tmp_path):
    from areal_jax import config as config_lib
    from areal_jax.system.job import RLJob
    from areal_jax.testing.tiny import tiny_config

    c = tiny_config(str(tmp_path), eta=0, steps=3)
    other = write_splits(str(tmp_path / "other"), n_train=5, n_test=2, seed=9)["train"]
    c.data.train_path, c.data.train_weights = f"main={c.data.train_path},other={other}", "1,1"
    job = RLJob(config_lib.validate(c), log_fn=lambda *a, **k: None)
    try:
        job.run()
    finally:
        job.close()
    samples = [json.loads(line) for line in open(os.path.join(c.run_dir, "samples.jsonl"))]
    metrics = [json.loads(line) for line in open(os.path.join(c.run_dir, "metrics.jsonl"))]
    steps = [m for m in metrics if "source/main/groups" in m]
    assert len(steps) == 3
    for m in steps:  # each step's groups, counted per source, and their rewards from the sample log
        trained = [s for s in samples if s["trained_version"] == m["step"] - 1]
        for name in ("main", "other"):
            mine = [s for s in trained if s["uid"].startswith(f"{name}:")]
            assert m[f"source/{name}/groups"] == len(mine)
            if mine:
                assert m[f"source/{name}/reward"] == pytest.approx(np.mean([r for s in mine for r in s["rewards"]]))
    assert {s["uid"].split(":")[0] for s in samples} == {"main", "other"}
    from areal_jax.programs.report import plot_curves
    from areal_jax.programs.report import source_names as plotted_sources

    assert plotted_sources(metrics) == ["main", "other"]  # the curves plot draws each file's reward
    plot_curves(metrics, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("weights", ["1,3", "20,1", "1,1"])
def test_a_pass_of_a_mixture_draws_every_row_of_every_file(files, tok, weights):
    """pass_draws, the run of retired draws after which the controller takes every task as retired: within that
    many draws every row of every file has come (and for weights 1,3: max(7 / 0.25, 31 / 0.75) = 42 draws)."""
    small, large = files
    stream = _stream(_data(f"s={small},l={large}", weights), tok)
    seen = {u.rsplit(":", 1)[0] for u in _uids(stream, stream.pass_draws)}
    assert seen == {f"s:{r}" for r in range(1, SMALL + 1)} | {f"l:{r}" for r in range(1, LARGE + 1)}
    if weights == "1,3":
        assert stream.pass_draws == 42
    assert _stream(_data(small), tok).pass_draws == SMALL


def test_a_directory_or_glob_of_shards_reads_as_one_file(files, tok, tmp_path):
    small, large = files
    rows = open(large).read().splitlines()
    shards = tmp_path / "taco"
    shards.mkdir()
    for i in range(3):  # a dataset's shards, as the Hub writes them
        (shards / f"train-{i:05d}-of-00003.jsonl").write_text("\n".join(rows[i::3]) + "\n")
    (shards / "README.md").write_text("not data\n")
    one = _stream(_data(str(shards)), tok)  # a bare directory: one dataset, named by the directory
    assert source_names(_data(f"{shards},s={small}")) == ["taco", "s"]
    assert sorted(u.rsplit(":", 1)[0] for u in _uids(one, LARGE)) == sorted(
        f"train-{i:05d}-of-00003.jsonl:{r}" for i in range(3) for r in range(1, len(rows[i::3]) + 1))
    mixed = _stream(_data(f"t={shards}/train-*.jsonl,s={small}", "1,1"), tok)  # a glob inside a mixture
    keys = {u.rsplit(":", 1)[0] for u in _uids(mixed, 4 * LARGE) if u.startswith("t:")}
    assert keys == {f"t:train-{i:05d}-of-00003:{r}" for i in range(3) for r in range(1, len(rows[i::3]) + 1)}
    from areal_jax.data.sources import parse_named_paths

    assert parse_named_paths(f"{shards}/*.jsonl", "data.train_path")[0].name == "taco"
    model = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "math_reasoner")
    c = JobConfig().replace(model=JobConfig().model.replace(path=model), eval=JobConfig().eval.replace(n_test=0))
    with pytest.raises(ConfigError, match=r"'.*/taco/\*.parquet' \(the file named 'p'\) matches no .jsonl or .parquet"):
        validate(c.replace(data=_data(f"s={small},p={shards}/*.parquet")))
    from areal_jax.evaluation.sets import load_eval_sets

    sets = load_eval_sets(f"taco={shards}", tok, _data(small), n=50)  # an evaluation set of shards: all its rows
    assert len(sets["taco"]) == LARGE
