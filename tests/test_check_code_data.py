"""programs/check_code_data.py: a dataset's own reference solutions against its tests, and its checkers against its
listed outputs. Rows built by hand with known outcomes in every layout that carries references."""
from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from areal_jax.programs.check_code_data import check_rows, echo_program, reference_solutions

ADD = "a, b = map(int, input().split())\nprint(a + b)"
IO = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
SPLIT_CHECKER = ("import sys\nn = int(open(sys.argv[1]).read())\ngot = open(sys.argv[3]).read().split()\n"
                 "print(1 if len(got) == 2 and sum(map(int, got)) == n else 0)")


def _rows():
    return [
        {"question": "Add two numbers.", "input_output": IO, "solutions": json.dumps(["print(0)", ADD])},  # 2nd passes
        {"question": "Add two numbers.", "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["4\n"]}),
         "solutions": json.dumps([ADD])},  # wrong tests: the reference fails
        {"question": "Add.", "input_output": IO},  # no reference, no checker
        {"description": "Add.", "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
         "solutions": {"language": [2, 3], "solution": ["int main() {}", ADD]}},  # CodeContests: the Python 3 one
        {"text": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3"], "code": "def add(a, b):\n    return a + b"},
        {"prompt": "def add(a, b):\n", "entry_point": "add", "canonical_solution": "    return a + b\n",
         "test": "def check(candidate):\n    assert candidate(2, 2) == 4\n"},
        {"description": "Split n.", "official_tests": [{"input": "7\n", "output": "3 4\n"}],
         "generated_checker": SPLIT_CHECKER},  # the checker accepts its listed output
        {"description": "Split n.", "official_tests": [{"input": "7\n", "output": "3 5\n"}],
         "generated_checker": SPLIT_CHECKER},  # ... and rejects a wrong listed output
        {"question": "no tests here"},
        {"description": "Add.", "public_tests": {"input": ["1 1\n"], "output": ["2\n"]},  # weak: a*2 passes too
         "solutions": {"language": [3], "solution": [ADD]},
         "incorrect_solutions": {"language": [2, 3, 3], "solution": ["int main() {}", "print(0)",
                                                                      "a, b = map(int, input().split())\nprint(a * 2)"]}},
        {"description": "Add.", "public_tests": {"input": ["1 2\n", "2 2\n"], "output": ["3\n", "4\n"]},  # strong
         "solutions": {"language": [3], "solution": [ADD]},
         "incorrect_solutions": {"language": [3], "solution": ["a, b = map(int, input().split())\nprint(a * 2)"]}},
    ]


EXPECTED = ["passed", "failed", "unchecked", "passed", "passed", "passed", "passed", "checker_rejects", "bad_row",
            "weak_tests", "passed"]


def test_each_row_gets_the_status_its_references_and_checker_give(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    results = list(check_rows([str(path)], workers=2, progress=None))
    assert [r["status"] for r in results] == EXPECTED
    # checked a few rows at a time (a large file is never held whole): the same results, in the same order
    chunked = list(check_rows([str(path)], workers=2, chunk_rows=2, progress=None))
    assert [(r["row"], r["status"], r["pass_rate"]) for r in chunked] == [
        (r["row"], r["status"], r["pass_rate"]) for r in results]
    assert results[0]["pass_rate"] == 1.0 and results[1]["pass_rate"] == 0.0
    assert "known-wrong solution 2" in results[9]["detail"]  # the C++ one is not run, print(0) fails, a * 2 passes
    assert [r["status"] for r in check_rows([str(path)], max_incorrect=0, progress=None)][9] == "passed"
    assert [r["row"] for r in results] == list(range(1, len(EXPECTED) + 1))
    assert "line 9" in results[8]["detail"] and "no tests" in results[8]["detail"]


def test_references_by_layout_and_the_echo_program():
    rows = _rows()
    assert reference_solutions(rows[0]) == ["print(0)", ADD]
    assert reference_solutions(rows[3]) == [ADD]  # C++ left out
    assert reference_solutions(rows[5]) == ["def add(a, b):\n    return a + b\n"]
    assert reference_solutions(rows[2]) == [] and reference_solutions({"solutions": "not json"}) == []
    echo = echo_program((("1 2\n", "3\n"), ("x\n", "line one\nline 'two'\n")))
    for stdin, expected in (("1 2\n", "3\n"), ("x\n", "line one\nline 'two'\n")):
        out = subprocess.run([sys.executable, "-c", echo], input=stdin, capture_output=True, text=True, timeout=30)
        assert out.stdout == expected


def test_the_command_writes_the_kept_rows_and_a_report_and_reads_parquet(tmp_path):
    rows = _rows()[:3]
    parquet = tmp_path / "tasks.parquet"
    rows.append({"question": "  Multiply   TWO numbers.", "input_output": IO})  # a test task, spelled otherwise
    pq.write_table(pa.Table.from_pylist(rows), str(parquet))
    test_split = tmp_path / "test.jsonl"
    test_split.write_text(json.dumps({"question": "multiply two numbers.", "input_output": IO}) + "\n")
    out, report = tmp_path / "clean.jsonl", tmp_path / "report.jsonl"
    proc = subprocess.run([sys.executable, "-m", "areal_jax.programs.check_code_data", f"--data={parquet}",
                           f"--out={out}", f"--report={report}", f"--exclude={test_split}"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == {"rows": 4, "passed": 1, "failed": 1, "checker_rejects": 0, "weak_tests": 0, "unchecked": 1,
                       "excluded": 1, "bad_row": 0, "kept": 2}
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [k["question"] for k in kept] == [rows[0]["question"], rows[2]["question"]]
    statuses = [json.loads(line)["status"] for line in report.read_text().splitlines()]
    assert statuses == ["passed", "failed", "unchecked", "excluded"]
    bad = subprocess.run([sys.executable, "-m", "areal_jax.programs.check_code_data", "--data=/no/such.jsonl"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--data='/no/such.jsonl' does not exist" in bad.stderr
