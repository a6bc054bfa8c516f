"""Readers of programming tasks: APPS / TACO stdin and call-based rows, MBPP assert lists, HumanEval test
programs, from JSONL and Parquet; malformed rows named by file and row; hidden tests never in prompts."""

import json

import pytest

from areal_jax.data import load_prompt_source
from areal_jax.data.code_readers import read_code_records
from areal_jax.data.code_tokenizer import build_code_tokenizer
from areal_jax.rewards.code_tests import parse_tests

APPS_STDIO = {"question": "Read two integers and print their sum.",
              "input_output": json.dumps({"inputs": ["1 2\n", ["3", "4"]], "outputs": ["3\n", ["7"]]})}
APPS_CALL = {"question": "Return the sum of a and b.",
             "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2], [5, 6]], "outputs": [[3], [11]]})}
MBPP = {"text": "Write a function to remove the first and last occurrence of a character from a string.",
        "test_list": ["assert remove_Occ('hello','l') == 'heo'", "assert remove_Occ('abcda','a') == 'bcd'"],
        "test_setup_code": ""}
HUMANEVAL = {"prompt": "def add(a: int, b: int) -> int:\n    \"\"\"Add a and b.\"\"\"\n",
             "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
             "entry_point": "add"}
GOOD_ROWS = [APPS_STDIO, APPS_CALL, MBPP, HUMANEVAL]
BAD_ROWS = [
    ({"question": "q", "input_output": "{not json"}, "not valid JSON"),
    ({"question": "q", "input_output": {"inputs": [], "outputs": []}}, "no test case"),
    ({"question": "q", "input_output": {"inputs": ["1"], "outputs": []}}, "1 inputs but 0 outputs"),
    ({"text": "t", "test_list": []}, "'test_list' is empty"),
    ({"text": "t", "test_list": ["assert f(1) =="]}, "does not parse"),
    ({"question": "q"}, "no tests"),
    ({"input_output": {"inputs": ["1"], "outputs": ["1"]}}, "no problem statement"),
    ({"question": "q", "input_output": {"fn_name": "1bad", "inputs": [[1]], "outputs": [1]}}, "identifier"),
]


def _write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def test_each_layout_becomes_the_tests_it_describes(tmp_path):
    records, stats = read_code_records(_write_jsonl(tmp_path / "t.jsonl", GOOD_ROWS))
    assert stats.rows_kept == 4 and stats.bad_rows_skipped == 0
    stdio, call, mbpp, humaneval = (parse_tests(r.answer) for r in records)
    assert stdio.stdio == (("1 2\n", "3\n"), ("3\n4\n", "7\n"))  # a list of lines is joined
    assert [expected for _, expected in call.calls] == [[3], [11]]
    assert mbpp.calls == (("remove_Occ('hello', 'l')", "heo"), ("remove_Occ('abcda', 'a')", "bcd"))
    assert humaneval.calls == (("add(2, 3)", 5), ("add(-1, 1)", 0))
    # The function the tests call is named in the prompt when the statement does not mention it.
    assert records[1].question.endswith("named add.") and records[2].question.endswith("named remove_Occ.")
    assert records[3].question == HUMANEVAL["prompt"]  # "add" already appears
    assert [r.row for r in records] == [1, 2, 3, 4]


@pytest.mark.parametrize("row, message", BAD_ROWS)
def test_malformed_rows_name_file_and_line_or_are_skipped(tmp_path, row, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [MBPP, row])
    with pytest.raises(ValueError, match=rf"bad.jsonl, line 2: .*{message}.*on_bad_row='skip'"):
        read_code_records(path)
    records, stats = read_code_records(path, on_bad_row="skip")
    assert len(records) == 1 and stats.bad_rows_skipped == 1 and "line 2" in stats.bad_row_messages[0]


def test_invalid_json_lines_and_an_all_bad_file(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [MBPP], raw_lines=["{oops"])
    records, stats = read_code_records(path, on_bad_row="skip")
    assert len(records) == 1 and "line 2: invalid JSON" in stats.bad_row_messages[0]
    with pytest.raises(ValueError, match="no usable rows"):
        read_code_records(_write_jsonl(tmp_path / "b.jsonl", [BAD_ROWS[0][0]]), on_bad_row="skip")


def test_parquet_rows_match_jsonl_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [APPS_STDIO, APPS_STDIO | {"input_output": "[]"}, APPS_CALL]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "t.parquet"))
    records, stats = read_code_records(str(tmp_path / "t.parquet"), on_bad_row="skip")
    expected, _ = read_code_records(_write_jsonl(tmp_path / "t.jsonl", [APPS_STDIO, APPS_CALL]))
    assert [r.answer for r in records] == [r.answer for r in expected]
    assert stats.bad_rows_skipped == 1 and "row index 1" in stats.bad_row_messages[0]


def test_prompts_use_the_chat_template_and_never_show_hidden_tests(tmp_path):
    tokenizer = build_code_tokenizer()
    path = _write_jsonl(tmp_path / "t.jsonl", GOOD_ROWS)
    source = load_prompt_source(path, tokenizer, task="code", question_field="auto", use_chat_template=True)
    texts = [tokenizer.decode(list(item.prompt_tokens)) for item in source.items]
    assert texts[2] == f"Question: {MBPP['text']}\nWrite it as a Python function named remove_Occ.\nAnswer:"
    hidden = ["'heo'", "bcd", "3\n4", "candidate(2, 3)", "== 5", "11"]
    for text in texts:
        assert not any(h in text for h in hidden), text
    with pytest.raises(ValueError, match="task='nope'"):
        load_prompt_source(path, tokenizer, task="nope")


# DeepCoder: "problem", "tests" as a JSON list of cases, "metadata" naming the function of functional ones.
DEEPCODER_STDIN = {"problem": "Print the sum of two integers.", "metadata": "{}",
                   "tests": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
                                        {"input": "5 5\n", "output": "10\n", "testtype": "stdin"}])}
DEEPCODER_CALL = {"problem": "Given nums and k, count the elements above k.",
                  "metadata": json.dumps({"func_name": "countAbove"}),
                  "tests": json.dumps([{"input": "[1, 5, 7]\n4", "output": "2", "testtype": "functional"},
                                       {"input": "[]\n0", "output": "0", "testtype": "functional"}])}
PRIME_CALL = {"problem": "Double it.",
              "tests": [{"type": "function_call", "fn_name": "double", "input": [4], "output": [8]}]}
DEEPCODER_TACO = {"problem": "Print n squared.", "tests": {"inputs": ["3\n"], "outputs": ["9\n"]}}
LCB = {"question_content": "Print the maximum of the numbers.", "metadata": "{}",
       "public_test_cases": json.dumps([{"input": "3\n1 9 4\n", "output": "9\n", "testtype": "stdin"}]),
       "private_test_cases": json.dumps([{"input": "1\n-2\n", "output": "-2\n", "testtype": "stdin"}])}


def test_deepcoder_and_livecodebench_case_lists(tmp_path):
    rows = [DEEPCODER_STDIN, DEEPCODER_CALL, PRIME_CALL, DEEPCODER_TACO, LCB]
    records, stats = read_code_records(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert stats.rows_kept == 5
    stdin, call, prime, taco, lcb = (parse_tests(r.answer) for r in records)
    assert stdin.stdio == (("1 2\n", "3\n"), ("5 5\n", "10\n")) and not stdin.calls
    # One JSON argument a line; the expected value is the output's JSON.
    assert call.calls == (("(globals().get('countAbove') or Solution().countAbove)(*[[1, 5, 7], 4])", 2),
                          ("(globals().get('countAbove') or Solution().countAbove)(*[[], 0])", 0))
    assert prime.calls == (("(globals().get('double') or Solution().double)(*[4])", [8]),)
    assert taco.stdio == (("3\n", "9\n"),)
    assert lcb.stdio == (("3\n1 9 4\n", "9\n"), ("1\n-2\n", "-2\n"))  # public then private cases
    assert records[1].question.endswith("named countAbove.") and records[2].question.endswith("named double.")
    assert records[0].question == DEEPCODER_STDIN["problem"] and records[4].question == LCB["question_content"]
    for record in records:  # hidden tests never reach the prompt
        assert "10\n" not in record.question and "-2" not in record.question


def _compressed(value) -> str:
    """LiveCodeBench's encoding of its private tests: base64 of zlib of a pickled JSON string."""
    import base64
    import pickle
    import zlib

    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(value)))).decode()


def test_livecodebench_compressed_private_tests_read_like_their_json(tmp_path):
    cases = json.loads(LCB["private_test_cases"]) + [{"input": "2\n5 -5\n", "output": "5\n", "testtype": "stdin"}]
    plain = dict(LCB, private_test_cases=json.dumps(cases))
    packed = dict(LCB, private_test_cases=_compressed(cases))
    (a,), _ = read_code_records(_write_jsonl(tmp_path / "plain.jsonl", [plain]))
    (b,), _ = read_code_records(_write_jsonl(tmp_path / "packed.jsonl", [packed]))
    assert parse_tests(b.answer) == parse_tests(a.answer)
    assert parse_tests(b.answer).stdio == (("3\n1 9 4\n", "9\n"), ("1\n-2\n", "-2\n"), ("2\n5 -5\n", "5\n"))


class _Payload:
    """Pickles as a call of open(path, "w"): unpickling it with pickle.loads would create the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_a_compressed_field_that_would_call_code_is_refused_and_nothing_runs(tmp_path, protocol):
    import base64
    import pickle
    import zlib

    marker = tmp_path / "ran"
    text = base64.b64encode(zlib.compress(pickle.dumps([_Payload(str(marker))], protocol=protocol))).decode()
    row = dict(LCB, private_test_cases=text)
    with pytest.raises(ValueError, match="line 1: .*pickle naming .*open; only plain data"):
        read_code_records(_write_jsonl(tmp_path / "evil.jsonl", [row]))
    assert not marker.exists()
    bad_json = dict(LCB, private_test_cases=base64.b64encode(zlib.compress(pickle.dumps("[{"))).decode())
    with pytest.raises(ValueError, match="holds a string that is not JSON"):
        read_code_records(_write_jsonl(tmp_path / "j.jsonl", [bad_json]))


def test_livecodebench_starter_code_joins_the_statement(tmp_path):
    starter = "class Solution:\n    def countAbove(self, nums: List[int], k: int) -> int:\n        "
    row = {"question_content": "Count the elements above k.", "starter_code": starter,
           "metadata": DEEPCODER_CALL["metadata"], "public_test_cases": DEEPCODER_CALL["tests"]}
    record = read_code_records(_write_jsonl(tmp_path / "l.jsonl", [row]))[0][0]
    assert record.question == ("Count the elements above k.\n\nStart from:\n```python\n" + starter.strip() + "\n```")
    assert parse_tests(record.answer) == parse_tests(read_code_records(
        _write_jsonl(tmp_path / "d.jsonl", [DEEPCODER_CALL]))[0][0].answer)


def test_deepcoder_functional_rows_score_a_leetcode_solution(tmp_path):
    from areal_jax.rewards.code import code_tests_reward

    answer = read_code_records(_write_jsonl(tmp_path / "d.jsonl", [DEEPCODER_CALL]))[0][0].answer
    good = ("class Solution:\n    def countAbove(self, nums, k):\n        return sum(x > k for x in nums)")
    assert code_tests_reward(good, answer, case_timeout_s=2.0) == 1.0
    wrong = "def countAbove(nums, k):\n    return len(nums)"  # right only for the empty list
    assert code_tests_reward(wrong, answer, case_timeout_s=2.0, mode="pass_rate") == 0.5


CASE_LIST_BAD_ROWS = [
    ({"problem": "p", "tests": "[]"}, "'tests' holds no test case"),
    ({"problem": "p", "tests": [{"input": "1"}]}, "must be an object with 'input' and 'output'"),
    ({"problem": "p", "tests": [{"input": "1", "output": "1", "testtype": "functional"}]}, "names no function"),
    ({"problem": "p", "tests": [{"input": "1", "output": "1", "testtype": "checker"}]}, "not stdin or functional"),
    ({"problem": "p", "metadata": '{"func_name": "f"}',
      "tests": [{"input": "[1,", "output": "1", "testtype": "functional"}]}, "is not JSON"),
    ({"question_content": "q", "public_test_cases": "[]", "private_test_cases": "eJzLSM3JyVcozy/KSQEAGgsEXQ=="},
     "decompresses to something that is not a pickle"),  # zlib of "hello world"
    ({"question_content": "q", "public_test_cases": "[]", "private_test_cases": "aGVsbG8gd29ybGQgaGVsbG8="},
     "base64 but not zlib-compressed"),
    ({"prompt_text": "p", "test_list": ["assert f(1) == 1"], "task_id": 3}, "text fields: 'prompt_text'"),
]


@pytest.mark.parametrize("row, message", CASE_LIST_BAD_ROWS)
def test_malformed_case_lists_are_named_or_skipped(tmp_path, row, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [DEEPCODER_STDIN, row])
    with pytest.raises(ValueError, match=f"bad.jsonl, line 2: .*{message}"):
        read_code_records(path)
    records, stats = read_code_records(path, on_bad_row="skip")
    assert len(records) == 1 and stats.bad_rows_skipped == 1


def test_auto_question_field_picks_the_layouts_statement(tmp_path):
    # MBPP (text), sanitized MBPP (prompt), HumanEval (prompt), APPS (question), DeepCoder (problem):
    # each row also carries a decoy text field another layout would use.
    rows = [dict(MBPP, prompt="decoy"), {"prompt": "Remove chars.", "test_list": MBPP["test_list"]},
            dict(HUMANEVAL, text="decoy"), dict(APPS_STDIO, problem="decoy"), dict(DEEPCODER_STDIN, question="decoy")]
    records, _ = read_code_records(_write_jsonl(tmp_path / "a.jsonl", rows), question_field="auto")
    assert [r.question.split("\n")[0] for r in records] == [
        MBPP["text"], "Remove chars.", HUMANEVAL["prompt"].split("\n")[0], APPS_STDIO["question"],
        DEEPCODER_STDIN["problem"]]


def test_deepcoder_and_livecodebench_parquet_rows_match_their_jsonl_rows(tmp_path):
    # In one Parquet table every row has every column: the fields of the other layout are null.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [DEEPCODER_STDIN, DEEPCODER_CALL, LCB]
    columns = {key: [row.get(key) for row in rows] for row in rows for key in row}
    pq.write_table(pa.table(columns), str(tmp_path / "d.parquet"))
    from_parquet, stats = read_code_records(str(tmp_path / "d.parquet"))
    from_jsonl, _ = read_code_records(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert stats.rows_kept == 3 and [r.row for r in from_parquet] == [0, 1, 2]
    assert [(r.question, r.answer) for r in from_parquet] == [(r.question, r.answer) for r in from_jsonl]


CONTESTS = {"name": "1_A", "description": "Read n numbers and print their maximum.",
            "public_tests": {"input": ["3\n1 9 4\n"], "output": ["9\n"]},
            "private_tests": json.dumps({"input": ["1\n-2\n"], "output": ["-2\n"]}),
            "generated_tests": {"input": ["2\n5 5\n", "4\n0 0 0 1\n"], "output": ["5\n", "1\n"]},
            "solutions": {"language": [3], "solution": ["input()\nprint(max(map(int, input().split())))"]}}


def test_codecontests_rows_run_every_listed_case_as_stdin(tmp_path):
    from areal_jax.rewards.code import code_tests_reward

    (record,), _ = read_code_records(_write_jsonl(tmp_path / "cc.jsonl", [CONTESTS]))
    spec = parse_tests(record.answer)
    assert spec.stdio == (("3\n1 9 4\n", "9\n"), ("1\n-2\n", "-2\n"), ("2\n5 5\n", "5\n"),
                          ("4\n0 0 0 1\n", "1\n")) and not spec.calls
    assert record.question == CONTESTS["description"] and "-2" not in record.question
    good = "```python\ninput()\nprint(max(map(int, input().split())))\n```"
    assert code_tests_reward(good, record.answer) == 1.0
    import pyarrow as pa  # the dataset's own Parquet form: the test fields are structs of string lists
    import pyarrow.parquet as pq

    row = dict(CONTESTS, private_tests=json.loads(CONTESTS["private_tests"]))
    pq.write_table(pa.Table.from_pylist([row]), str(tmp_path / "cc.parquet"))
    (from_parquet,), _ = read_code_records(str(tmp_path / "cc.parquet"))
    assert parse_tests(from_parquet.answer) == spec and from_parquet.question == record.question
    assert code_tests_reward("input()\nprint(max(map(int, input().split()[:2])))", record.answer) == 0.0


@pytest.mark.parametrize("row, message", [
    (dict(CONTESTS, public_tests={"input": ["1\n"]}), "'public_tests' must be an object with 'input' and 'output'"),
    (dict(CONTESTS, generated_tests={"input": ["1\n"], "output": []}), "'generated_tests' has 1 inputs but 0"),
    ({"description": "d", "public_tests": {"input": [], "output": []}, "private_tests": None}, "hold no test case"),
])
def test_malformed_codecontests_rows_are_named(tmp_path, row, message):
    with pytest.raises(ValueError, match=f"cc.jsonl, line 1: .*{message}"):
        read_code_records(_write_jsonl(tmp_path / "cc.jsonl", [row]))


@pytest.mark.parametrize("value, seconds", [
    ({"seconds": 2, "nanos": 500000000}, 2.5), ({"seconds": 1}, 1.0), (3, 3.0), (0.25, 0.25),
    ("1 second", 1.0), ("2.0 seconds", 2.0), ("1.5 s", 1.5), ("500 ms", 0.5), (" 4 Seconds ", 4.0),
    ("None", 0.0), ("", 0.0), (None, 0.0), ("fast", 0.0), (-1, 0.0), (True, 0.0), ({"seconds": "2"}, 0.0),
    (float("nan"), 0.0),
])
def test_time_limits_are_read_in_each_layout(value, seconds):
    from areal_jax.data.code_readers import time_limit_seconds

    assert time_limit_seconds(value) == seconds


def test_a_contest_time_limit_travels_with_the_tests_and_bounds_each_case(tmp_path):
    from areal_jax.rewards.code import run_tests

    (timed,), _ = read_code_records(_write_jsonl(tmp_path / "t.jsonl", [
        dict(CONTESTS, time_limit={"seconds": 0, "nanos": 500000000})]))
    (untimed,), _ = read_code_records(_write_jsonl(tmp_path / "u.jsonl", [CONTESTS]))
    spec = parse_tests(timed.answer)
    assert spec.time_limit_s == 0.5 and parse_tests(untimed.answer).time_limit_s == 0.0
    slow = "import time\ntime.sleep(1.5)\ninput()\nprint(max(map(int, input().split())))"
    one = type(spec)(stdio=spec.stdio[:1], time_limit_s=spec.time_limit_s)
    assert run_tests(slow, one, case_timeout_s=4.0).statuses == ("pass",)  # factor 0: the row's limit unused
    assert run_tests(slow, one, case_timeout_s=4.0, time_limit_factor=2.0).statuses == ("timeout",)  # 1.0 s
    assert run_tests(slow, one, case_timeout_s=4.0, time_limit_factor=8.0).statuses == ("pass",)  # min(4.0, 4.0)
    with pytest.raises(ValueError, match="time_limit_factor must be >= 0"):
        run_tests(slow, one, time_limit_factor=-1.0)


def test_leetcode_style_function_tasks_get_the_names_their_judges_provide(tmp_path):
    """LiveCodeBench / TACO call-based rows: a solution using List, Counter, reduce and heappush without importing them
    passes, as on LeetCode; the builtin three-argument pow is untouched; an MBPP row gets nothing extra."""
    from areal_jax.rewards.code import code_tests_reward
    from areal_jax.rewards.code_feedback import code_feedback
    from areal_jax.rewards.code_tests import CALL_PRELUDE

    lcb = {"question_content": "Return the sum of nums plus 2^10 mod 7.",
           "starter_code": "class Solution:\n    def total(self, nums: List[int]) -> int:\n        ",
           "public_test_cases": json.dumps([{"input": "[1, 2, 3]", "output": "8", "testtype": "functional"}]),
           "metadata": json.dumps({"func_name": "total"})}
    taco = {"question": "Return the sum of nums plus 2^10 mod 7.", "fn_name": "total",
            "input_output": json.dumps({"fn_name": "total", "inputs": [[[1, 2, 3]]], "outputs": [8]})}
    mbpp = {"text": "Write total(nums).", "test_list": ["assert total([1, 2, 3]) == 8"]}
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (lcb, taco, mbpp)))
    records, _ = read_code_records(str(path))
    body = ("    def total(self, nums: List[int]) -> int:\n        heap = []\n        for x in Counter(nums).elements():\n"
            "            heappush(heap, x)\n        return reduce(lambda a, b: a + b, heap) + pow(2, 10, 7)\n")
    leetcode = f"```python\nclass Solution:\n{body}```"
    function = "```python\ndef total(nums: List[int]) -> int:\n    return sum(nums) + pow(2, 10, 7)\n```"
    assert code_tests_reward(leetcode, records[0].answer) == 1.0
    assert code_tests_reward(function, records[1].answer) == 1.0
    assert parse_tests(records[0].answer).setup.startswith(CALL_PRELUDE)
    assert parse_tests(records[2].answer).setup == ""  # MBPP's tests import what they use
    assert code_tests_reward(function, records[2].answer) == 0.0  # List is not given there: a NameError at load
    # an error's line is still counted in the program, after the prelude
    passed, text = code_feedback("```python\nclass Solution:\n    def total(self, nums):\n        return nums[9]\n```",
                                 records[0].answer)
    assert not passed and "IndexError" in text and "(line 3 of your program)" in text
