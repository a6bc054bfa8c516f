"""JSONL / Parquet readers: row-numbered errors, skip-and-count, GSM8K answer extraction."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_jax.data import extract_reference_answer, read_jsonl, read_parquet, read_records

GOOD = {"question": "Natalia sold clips to 48 friends. How many?", "answer": "48/2 = <<48/2=24>>24\n#### 72"}


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("bad_line, reason", [
    ('{"question": "q", "answer": "#### 1"', "invalid JSON"),
    ('{"answer": "#### 1"}', "no question field: none of 'question', 'problem', 'prompt' is present"),
    ('{"question": null, "answer": "#### 1"}', "field 'question' is null"),
    ('{"question": 17, "answer": "#### 1"}', "field 'question' must be a string, got int"),
    ('{"question": "q", "answer": ["#### 1"]}', "field 'answer' must be a string or a number, got list"),
    ('{"question": "   ", "answer": "#### 1"}', "field 'question' is empty"),
    ('["question", "answer"]', "expected a JSON object, got list"),
    ('{"question": "q", "answer": "72 ####"}', "nothing follows the '####' marker"),
])
def test_jsonl_errors_name_file_line_and_reason(tmp_path, bad_line, reason):
    # A blank line before the bad one: line numbers are the file's lines, blank ones included.
    path = _write_lines(tmp_path / "data.jsonl", [json.dumps(GOOD), "", json.dumps(GOOD), bad_line, json.dumps(GOOD)])
    with pytest.raises(ValueError) as err:
        read_jsonl(path)
    message = str(err.value)
    assert path in message and "line 4:" in message and reason in message and "on_bad_row='skip'" in message


def test_gsm8k_format_requires_the_marker(tmp_path):
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps({"question": "q", "answer": "72"})])
    assert read_jsonl(path)[0][0].answer == "72"  # "auto": a field without "####" is the answer itself
    with pytest.raises(ValueError, match=r"line 1: the answer has no '####' marker"):
        read_jsonl(path, answer_format="gsm8k")


def test_jsonl_skip_mode_counts_bad_rows(tmp_path):
    lines = [json.dumps(GOOD), "not json", json.dumps({"q": "x"}), "",
             json.dumps({"question": "Second?", "answer": 5}), json.dumps({"question": None, "answer": "1"})]
    records, stats = read_jsonl(_write_lines(tmp_path / "d.jsonl", lines), on_bad_row="skip")
    assert [(r.row, r.question, r.answer) for r in records] == [(1, GOOD["question"], "72"), (5, "Second?", "5")]
    assert stats.bad_rows_skipped == 3 and stats.rows_kept == 2
    assert [m.split(": ")[0].rsplit(", ", 1)[1] for m in stats.bad_row_messages] == ["line 2", "line 3", "line 6"]


def test_parquet_errors_and_skip(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"problem": ["a?", "b?", None, "d?"],
                             "solution": ["#### 1", "#### 2,000", "#### 3", None]}), path)
    with pytest.raises(ValueError) as err:
        read_parquet(path, question_field="problem", answer_field="solution")
    assert path in str(err.value) and "row index 2: field 'problem' is null" in str(err.value)
    records, stats = read_parquet(path, question_field="problem", answer_field="solution", on_bad_row="skip")
    assert [(r.row, r.answer) for r in records] == [(0, "1"), (1, "2000")] and stats.bad_rows_skipped == 2
    with pytest.raises(ValueError, match=r"column\(s\) \['question'\] missing .*'problem', 'solution'"):
        read_parquet(path, question_field="question", answer_field="solution")
    auto, _ = read_parquet(path, answer_field="solution", on_bad_row="skip")  # auto finds the 'problem' column
    assert [r.question for r in auto] == ["a?", "b?"]
    typed = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"question": [1, 2], "answer": ["#### 1", "#### 2"]}), typed)
    with pytest.raises(ValueError, match=r"row index 0: field 'question' must be a string, got int"):
        read_parquet(typed)


def test_empty_datasets_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no usable rows"):
        read_records(_write_lines(tmp_path / "empty.jsonl", []))
    with pytest.raises(ValueError, match=r"no usable rows \(2 malformed rows skipped\)"):
        read_records(_write_lines(tmp_path / "bad.jsonl", ["{", "[]"]), on_bad_row="skip")
    with pytest.raises(ValueError, match=r"name it \*.jsonl or \*.parquet"):
        read_records(_write_lines(tmp_path / "data.txt", [json.dumps(GOOD)]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="on_bad_row"):
        read_jsonl(_write_lines(tmp_path / "x.jsonl", [json.dumps(GOOD)]), on_bad_row="ignore")


def test_read_records_concatenates_files(tmp_path):
    a = _write_lines(tmp_path / "a.jsonl", [json.dumps(GOOD)])
    b = str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"question": ["p?"], "answer": ["#### 9"]}), b)
    records, _ = read_records([a, b])
    assert [(r.source, r.row, r.answer) for r in records] == [(a, 1, "72"), (b, 0, "9")]


@pytest.mark.parametrize("answer, expected", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72"),
    ("So the total is $1,000.\n#### 1,000", "1000"),
    ("#### 1,234,567 ", "1234567"),
    ("#### -5", "-5"),
    ("#### 0.25", "0.25"),
    ("a #### b #### 12", "12"),  # the last marker wins
    ("#### 1,23", "1,23"),  # not a thousands separator
])
def test_gsm8k_answer_extraction(answer, expected):
    assert extract_reference_answer(answer, "gsm8k") == expected
    assert extract_reference_answer(answer) == expected  # auto detects the marker


def test_raw_answer_extraction():
    assert extract_reference_answer("  \\frac{1}{2}\n") == "\\frac{1}{2}"
    assert extract_reference_answer(" 1,000 ", "raw") == "1,000"
    with pytest.raises(ValueError, match="no '####' marker"):
        extract_reference_answer("42", "gsm8k")
    with pytest.raises(ValueError, match="answer_format"):
        extract_reference_answer("42", "boxed")


def test_auto_question_field_takes_the_first_known_field_per_row(tmp_path):
    rows = [{"question": "gsm?", "problem": "not this", "answer": "#### 1"},  # question wins over problem
            {"problem": "math?", "answer": "2"},                             # MATH / DeepScaleR
            {"prompt": "p?", "answer": "3"},
            {"problem": None, "prompt": "p?", "answer": "4"}]                 # present but null: named, not skipped over
    path = _write_lines(tmp_path / "mixed.jsonl", [json.dumps(r) for r in rows])
    records, stats = read_jsonl(path, on_bad_row="skip")
    assert [(r.question, r.answer) for r in records] == [("gsm?", "1"), ("math?", "2"), ("p?", "3")]
    assert stats.bad_row_messages == [f"{path}, line 4: field 'problem' is null; give it a value or drop the row."]
    named, _ = read_jsonl(path, question_field="problem", on_bad_row="skip")
    assert [r.question for r in named] == ["not this", "math?"]


def test_a_byte_order_mark_and_crlf_lines_read_as_plain_utf8_and_other_encodings_name_their_line(tmp_path):
    rows = [GOOD, {"question": "Caf\u00e9 sells 3 cakes. How many?", "answer": "#### 3"}]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    bom = tmp_path / "bom.jsonl"  # as some editors save UTF-8: a BOM and \r\n line ends
    bom.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode("utf-8"))
    expected = [(r.question, r.answer) for r in read_jsonl(str(plain))[0]]
    assert [(r.question, r.answer) for r in read_jsonl(str(bom))[0]] == expected and len(expected) == 2
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl, line 2: not UTF-8 text \(byte 0xe9"):
        read_jsonl(str(latin1))
    records, stats = read_jsonl(str(latin1), on_bad_row="skip")
    assert len(records) == 1 and stats.bad_rows_skipped == 1
