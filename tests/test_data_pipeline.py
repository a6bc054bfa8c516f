"""Prompt stream: formatting, length filter, seeded shuffles, process shards, checkpointed state."""
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_jax.data import PromptExample, PromptIterator, load_eval_split, load_prompt_source, make_prompt_iterator
from areal_jax.data.math_tokenizer import build_math_tokenizer
from areal_jax.data.synthetic_math import write_splits
from areal_jax.tokenizer import Tokenizer

N = 23  # a prime, so shards and epochs do not line up


@pytest.fixture(scope="module")
def tok():
    return build_math_tokenizer()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_splits(str(tmp_path_factory.mktemp("math")), n_train=N, n_test=7, seed=3)


@pytest.fixture(scope="module")
def source(data, tok):
    return load_prompt_source(data["train"], tok)


def _questions(path):
    return [json.loads(line)["question"] for line in open(path)]


def _keys(examples):
    """uid "file:row:epoch" -> "file:row" (accepts examples or uids)."""
    return [getattr(e, "uid", e).rsplit(":", 1)[0] for e in examples]


def test_prompts_plain_and_chat_templates(data, tok):
    questions = _questions(data["train"])
    plain = load_prompt_source(data["train"], tok)
    assert [list(i.prompt_tokens) for i in plain.items] == [
        tok.encode(f"Question: {q}\nAnswer:", add_special_tokens=True) for q in questions]
    assert plain.items[0].answer == json.loads(open(data["train"]).readline())["answer"].split("#### ")[1]
    custom = load_prompt_source(data["train"], tok, prompt_template="{question} =", add_special_tokens=False)
    assert list(custom.items[2].prompt_tokens) == tok.encode(questions[2] + " =")
    chat = load_prompt_source(data["train"], tok, use_chat_template=True)
    assert [i.prompt_tokens for i in chat.items] == [i.prompt_tokens for i in plain.items]
    # A system prompt goes through the chat template as a system turn.
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] + '\n' }}"
                "{% else %}{{ 'Question: ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}")
    with_system = Tokenizer(tok.backend, eos_token="<eos>", chat_template=template)
    src = load_prompt_source(data["train"], with_system, use_chat_template=True, system_prompt="Tom has apples.")
    assert tok.decode(src.items[0].prompt_tokens) == f"Tom has apples.\nQuestion: {questions[0]}\nAnswer:"
    with pytest.raises(ValueError, match=r"must contain \{question\} exactly once"):
        load_prompt_source(data["train"], tok, prompt_template="Q: {q}")
    with pytest.raises(ValueError, match="system_prompt needs use_chat_template=True"):
        load_prompt_source(data["train"], tok, system_prompt="Be brief.")


def test_max_prompt_len_skips_and_counts_or_errors(data, tok):
    lengths = [len(tok.encode(f"Question: {q}\nAnswer:", add_special_tokens=True)) for q in _questions(data["train"])]
    limit = sorted(lengths)[N // 2]
    source = load_prompt_source(data["train"], tok, max_prompt_len=limit)
    assert source.num_too_long_skipped == sum(n > limit for n in lengths) > 0
    assert len(source) == sum(n <= limit for n in lengths)
    assert all(len(i.prompt_tokens) <= limit for i in source.items)
    assert make_prompt_iterator(data["train"], tok, max_prompt_len=limit, process_count=1,
                                process_index=0).num_too_long_skipped == source.num_too_long_skipped
    first_long = 1 + next(i for i, n in enumerate(lengths) if n > limit)
    with pytest.raises(ValueError, match=rf"train.jsonl, row {first_long}: the prompt has \d+ tokens"):
        load_prompt_source(data["train"], tok, max_prompt_len=limit, on_too_long="error")
    with pytest.raises(ValueError, match="Every prompt"):
        load_prompt_source(data["train"], tok, max_prompt_len=3)


def test_bad_rows_skipped_and_counted_through_the_pipeline(tmp_path, data, tok):
    lines = open(data["train"]).read().splitlines()
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines[:3] + ["{broken", '{"question": "x"}'] + lines[3:6]) + "\n")
    with pytest.raises(ValueError, match=r"mixed.jsonl, line 4: invalid JSON"):
        make_prompt_iterator(str(path), tok, process_index=0, process_count=1)
    it = make_prompt_iterator(str(path), tok, on_bad_row="skip", process_index=0, process_count=1)
    assert it.num_bad_rows_skipped == 2 and it.shard_size == 6
    assert sorted(int(k.split(":")[1]) for k in _keys(it.take(6))) == [1, 2, 3, 6, 7, 8]


def test_seeded_shuffle_reproducible_and_seed_dependent(source):
    def run(seed):
        return [e.uid for e in PromptIterator(source, seed=seed, process_index=0, process_count=1).take(3 * N)]

    a, b, c = run(0), run(0), run(1)
    assert a == b and a != c
    file_order = [i.key for i in source.items]
    for epoch in range(3):  # each epoch is a permutation of the data, reshuffled per epoch
        chunk = a[epoch * N:(epoch + 1) * N]
        assert sorted(u.rsplit(":", 1)[0] for u in chunk) == sorted(file_order)
        assert all(u.endswith(f":{epoch}") for u in chunk)
    assert _keys(a[:N]) != _keys(a[N:2 * N]) and _keys(a[:N]) != file_order
    unshuffled = PromptIterator(source, shuffle=False, process_index=0, process_count=1).take(N)
    assert _keys(unshuffled) == file_order


@pytest.mark.parametrize("count", [2, 3])
def test_process_shards_disjoint_and_cover(source, count):
    shards = [_keys(PromptIterator(source, seed=4, process_index=i, process_count=count).take(
        len(source.items[i::count]))) for i in range(count)]
    seen = Counter(k for shard in shards for k in shard)
    assert set(seen) == {i.key for i in source.items} and set(seen.values()) == {1}
    with pytest.raises(ValueError, match="process_index < process_count"):
        PromptIterator(source, process_index=2, process_count=2)


def test_state_restore_resumes_exactly(source):
    def fresh(seed=9):
        return PromptIterator(source, seed=seed, process_index=1, process_count=2)

    shard = len(source.items[1::2])
    for consumed in (0, 5, shard, shard + 3, 2 * shard - 1):  # start, mid-epoch, boundaries, later epochs
        it = fresh()
        it.take(consumed)
        state = json.loads(json.dumps(it.get_state()))  # survives JSON
        expected = it.take(shard + 2)
        restored = fresh()
        restored.take(4)  # wherever it was, set_state moves it
        restored.set_state(state)
        assert restored.next_index == consumed and restored.epoch == consumed // shard
        assert restored.take(shard + 2) == expected
    with pytest.raises(ValueError, match="seed: saved 9, now 10"):
        fresh(seed=10).set_state(state)
    with pytest.raises(ValueError, match="Not a prompt iterator state"):
        fresh().set_state({"next_index": 3})


def test_finite_epochs(source):
    it = PromptIterator(source, seed=0, num_epochs=2, process_index=0, process_count=1)
    out = list(it)
    assert len(out) == 2 * N and Counter(_keys(out)) == Counter({i.key: 2 for i in source.items})
    with pytest.raises(StopIteration):
        next(it)


def test_default_process_layout_and_types(source):
    it = PromptIterator(source, seed=0)  # jax.process_index() / process_count(): one process here
    assert (it.process_index, it.process_count) == (0, 1)
    example = next(it)
    assert isinstance(example, PromptExample) and isinstance(example.prompt_tokens, list)
    assert all(isinstance(t, int) for t in example.prompt_tokens)


def test_load_eval_split(tmp_path, data, tok):
    examples = load_eval_split(data["test"], tok)
    questions = _questions(data["test"])
    assert [e.question for e in examples] == questions
    assert [e.uid for e in examples] == [f"test.jsonl:{i}:0" for i in range(1, 8)]
    assert [e.question for e in load_eval_split(data["test"], tok, limit=3)] == questions[:3]
    assert [e.question for e in load_eval_split(data["test"], tok, process_index=1, process_count=2)] == questions[1::2]
    # Parquet with other field names and a raw answer column.
    path = str(tmp_path / "eval.parquet")
    pq.write_table(pa.table({"problem": questions, "final": [e.answer for e in examples]}), path)
    from_parquet = load_eval_split(path, tok, question_field="problem", answer_field="final")
    assert [(e.prompt_tokens, e.answer) for e in from_parquet] == [(e.prompt_tokens, e.answer) for e in examples]
    assert from_parquet[0].uid == "eval.parquet:0:0"
