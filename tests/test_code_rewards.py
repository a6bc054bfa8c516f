"""Code-execution rewards against hidden tests: correct / wrong / timeout / crash / huge output, stdin
programs and call-based functions, pass rate versus all-pass, and pass-everything hacks scoring 0."""

import json
import time

import pytest

from areal_jax.data.code_readers import read_code_records
from areal_jax.rewards.code import code_tests_reward, extract_program, make_code_reward, run_tests
from areal_jax.rewards.code_tests import TestSpec as Spec
from areal_jax.rewards.code_tests import asserts_to_spec, encode_tests, outputs_match, parse_tests, values_equal
from areal_jax.rewards.pool import RewardPool
from areal_jax.testing.hostile_code import HOSTILE_PROGRAMS

DIGIT_SUM = encode_tests(asserts_to_spec(["assert f(123) == 6", "assert f(0) == 0", "assert f(9) == 9",
                                          "assert f(4071) == 12"]))
STDIO_ADD = encode_tests(Spec(stdio=(("1 2\n", "3\n"), ("10 -4\n", "6\n"), ("0 0\n", "0\n"))))
CALL_APPS = encode_tests(Spec(calls=(("add(*[1, 2])", [3]), ("add(*[5, 5])", [10]))))
# The same tests as one opaque program (a loop the rewriter cannot see through), judged in the harness.
OPAQUE = encode_tests(asserts_to_spec("def check(candidate):\n"
                                      "    for x, want in [(123, 6), (0, 0), (9, 9), (4071, 12)]:\n"
                                      "        assert candidate(x) == want\n", entry_point="f"))
GOOD_F = "def f(x):\n    return sum(int(d) for d in str(x))"
GOOD_ADD = "a, b = map(int, input().split())\nprint(a + b)"


def reward(completion, answer=DIGIT_SUM, **kw):
    kw.setdefault("case_timeout_s", 2.0)
    return code_tests_reward(completion, answer, **kw)


def test_correct_and_wrong_programs_with_both_modes():
    assert reward(GOOD_F) == 1.0
    assert reward(f"Here it is:\n```python\n{GOOD_F}\n```\nDone.") == 1.0
    assert reward(" " + GOOD_F) == 1.0  # a completion continuing "Answer:" with a space
    wrong = "def f(x):\n    return x % 10"  # right only for f(0) and f(9)
    assert reward(wrong) == 0.0
    assert reward(wrong, mode="pass_rate") == pytest.approx(2 / 4)
    assert reward("the answer is 6") == 0.0  # not a program
    assert reward("") == 0.0


def test_stdin_stdout_cases_are_compared_as_output_match_says():
    assert reward(GOOD_ADD, STDIO_ADD) == 1.0
    assert reward("a, b = map(int, input().split())\nprint(a + b, '  ')\nprint()\n", STDIO_ADD) == 1.0
    leading_space = "a, b = map(int, input().split())\nprint(' ' + str(a + b))"
    assert reward(leading_space, STDIO_ADD) == 1.0  # tokens (the default, "numbers") pass it
    assert reward(leading_space, STDIO_ADD, output_match="tokens") == 1.0
    assert reward(leading_space, STDIO_ADD, output_match="lines") == 0.0  # lines only forgive trailing space
    assert reward("print(3)", STDIO_ADD, mode="pass_rate") == pytest.approx(1 / 3)
    assert outputs_match("1 2 \r\n3\n\n\n", "1 2\n3", "lines") and not outputs_match("1\n\n2", "1\n2", "lines")


@pytest.mark.parametrize("got, expected, lines, tokens, numbers", [
    ("1 2\n3\n", "1 2\n3", True, True, True),
    ("1\n2 3", "1 2\n3", False, True, True),  # the same tokens, other line breaks
    ("0.333333333", "0.3333333333333", False, False, True),  # |d| = 3e-10
    ("0.3333", "0.3333333333333", False, False, False),  # |d| = 3.3e-5 > 1e-6
    ("1000000.5", "1000000.0", False, False, True),  # relative: 0.5 <= 1e-6 * 1e6
    ("1000002.0", "1000000.0", False, False, False),  # relative: 2 > 1e-6 * 1e6
    ("3", "3.0", False, False, True),  # a real number expected: an integer that equals it passes
    ("3.0", "3", False, False, False),  # an integer expected: only that integer
    ("YES 2.5000001", "YES 2.5", False, False, True),
    ("yes 2.5", "YES 2.5", False, False, True),  # YES / NO in any case, as the contests' yes/no checker reads them
    ("No", "NO", False, False, True),
    ("alice", "Alice", False, False, False),  # other words exactly
    ("YESS", "YES", False, False, False),
    ("1.5e2", "150.0", False, False, True),
    ("nan", "1.0", False, False, False),
    ("1 2", "1 2 3", False, False, False),
])
def test_output_match_modes_worked_by_hand(got, expected, lines, tokens, numbers):
    assert outputs_match(got, expected, "lines") is lines
    assert outputs_match(got, expected, "tokens") is tokens
    assert outputs_match(got, expected, "numbers") is numbers
    assert outputs_match(got, expected) is numbers  # the default


def test_a_row_may_name_its_own_output_match():
    spec = Spec(stdio=(("", "0.5\n"),), output_match="lines")
    assert parse_tests(encode_tests(spec)) == spec
    program = "print('0.50000001')"
    assert run_tests(program, spec, output_match="numbers").statuses == ("fail",)  # the row's own wins
    assert run_tests(program, Spec(stdio=spec.stdio), output_match="numbers").statuses == ("pass",)
    with pytest.raises(ValueError, match="output_match='exact' is not one of lines, tokens, numbers"):
        Spec(stdio=spec.stdio, output_match="exact")


def test_call_based_cases_accept_the_apps_wrapped_output_and_solution_classes(tmp_path):
    assert reward("def add(a, b):\n    return a + b", CALL_APPS) == 1.0
    row = {"question": "Add.", "input_output": {"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [[3], [10]]}}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    answer = read_code_records(str(tmp_path / "t.jsonl"))[0][0].answer
    assert reward("def add(a, b):\n    return a + b", answer) == 1.0
    assert reward("class Solution:\n    def add(self, a, b):\n        return a + b", answer) == 1.0
    assert reward("class Solution:\n    def add(self, a, b):\n        return a * b", answer) == 0.0
    assert reward("class Solution:\n    pass\ndef add(a, b):\n    return a - b", CALL_APPS) == 0.0
    assert values_equal((1, 2), [1, 2]) and values_equal(0.1 + 0.2, 0.3) and not values_equal(1, "1")


def test_timeout_crash_and_huge_output_fail_within_their_limits():
    t0 = time.monotonic()
    assert reward("def f(x):\n    while True:\n        pass", case_timeout_s=1.0, mode="pass_rate") == 0.0
    assert time.monotonic() - t0 < 4 * 1.0 + 5.0  # every case bounded by its own limit
    t0 = time.monotonic()
    assert reward("while True:\n    pass", STDIO_ADD, case_timeout_s=1.0, sample_timeout_s=2.5,
                  mode="pass_rate") == 0.0
    assert time.monotonic() - t0 < 2.5 + 3.0  # the per-sample limit cuts the remaining cases
    assert reward("def f(x):\n    return 1 // 0") == 0.0
    assert reward("def f(x) return x") == 0.0  # syntax error
    assert reward("print('x' * 50_000_000)", STDIO_ADD) == 0.0
    assert reward("def f(x):\n    return [0] * 10**9") == 0.0  # MemoryError under the sandbox's limit


def test_all_pass_stops_at_the_first_failing_stdin_case():
    spec = parse_tests(STDIO_ADD)
    outcome = run_tests("print(0)", spec, mode="all_pass", case_timeout_s=2.0)
    assert outcome.statuses == ("fail", "not_run", "not_run")
    outcome = run_tests("print(0)", spec, mode="pass_rate", case_timeout_s=2.0)
    assert outcome.statuses == ("fail", "fail", "pass")


HACKS = HOSTILE_PROGRAMS


@pytest.mark.parametrize("name", sorted(HACKS))
def test_pass_everything_hacks_score_zero_on_assert_tests(name):
    assert reward(HACKS[name], mode="pass_rate") == 0.0, name
    assert reward(HACKS[name], OPAQUE, mode="pass_rate") == 0.0, name


def test_opaque_programs_cannot_be_passed_by_the_candidates_objects():
    assert reward(GOOD_F, OPAQUE) == 1.0
    eq_hacks = [HACKS["object equal to everything"], HACKS["int subclass equal to everything"],
                "class S(str):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return S()"]
    for hack in eq_hacks:
        assert reward(hack, OPAQUE, mode="pass_rate") == 0.0, hack
    # A helper the tests call from the standard library is the real one, not the program's own.
    spec = encode_tests(asserts_to_spec(["assert math.isclose(area(2), 12.566, rel_tol=1e-3)"], setup="import math"))
    assert reward("import math\ndef area(r):\n    return math.pi * r * r", spec) == 1.0
    fake = ("import math\nclass M:\n    def isclose(*a, **k):\n        return True\nmath = M()\n"
            "def area(r):\n    return 0.0")
    assert reward(fake, spec) == 0.0
    fake_module = ("import types\nmath = types.ModuleType('math')\nmath.isclose = lambda *a, **k: True\n"
                   "def area(r):\n    return 0.0")
    assert reward(fake_module, spec) == 0.0
    assert reward("def area(r):\n    return 0.0\ndef __getattr__(name):\n    return lambda *a, **k: True", spec) == 0.0


def test_opaque_cases_keep_their_limits_and_a_crashed_candidate_is_replaced():
    spec = encode_tests(asserts_to_spec(["assert f(1) in (2, 3)", "assert f(2) in (4, 5)", "assert f(3) in (6, 7)"]))
    assert len(parse_tests(spec).programs) == 3
    assert reward("def f(x):\n    return 2 * x", spec) == 1.0
    # f(1) hangs and f(2) kills its process: each fails alone, the next case gets a fresh candidate.
    flaky = ("import os\ndef f(x):\n    if x == 1:\n        while True:\n            pass\n"
             "    if x == 2:\n        os._exit(0)\n    return 2 * x")
    outcome = run_tests(flaky, parse_tests(spec), mode="pass_rate", case_timeout_s=1.0)
    assert outcome.statuses == ("timeout", "error", "pass")
    # A built-in exception the program raises reaches a test that expects it; a SystemExit does not.
    raises = encode_tests(asserts_to_spec(["try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False",
                                           "assert f(3) in (6, 7)"]))
    assert len(parse_tests(raises).programs) == 2
    assert reward("def f(x):\n    if x < 0:\n        raise ValueError(x)\n    return 2 * x", raises) == 1.0
    assert reward("def f(x):\n    return 2 * x", raises, mode="pass_rate") == 0.5
    assert reward("def f(x):\n    if x < 0:\n        raise SystemExit(0)\n    return 2 * x", raises,
                  mode="pass_rate") == 0.5
    # Forking is the harness's alone: the candidate process may not start or signal processes.
    spawn = "import os\ndef f(x):\n    return 2 * x if os.fork() else 2 * x"
    assert reward(spawn, spec, mode="pass_rate") == 0.0


@pytest.mark.parametrize("name", ["prints nothing", "exit(0)", "os._exit(0)", "stdout replaced"])
def test_pass_everything_hacks_score_zero_on_stdin_tests(name):
    assert reward(HACKS[name], STDIO_ADD, mode="pass_rate") == 0.0, name


def test_a_stolen_nonce_cannot_forge_reports():
    # The program finds the harness's nonce in its caller's frame (the payload is in its memory) and
    # writes "passed" reports, with the right value for f(123), to every descriptor it may hold: the
    # candidate process holds none of the harness's output, so nothing counts.
    forger = ("import os, sys\nnonce = sys._getframe(1).f_locals['payload']['nonce']\n"
              "for fd in range(64):\n"
              "    for i in range(4):\n"
              "        try:\n"
              "            line = nonce + ' {\"i\": %d, \"status\": \"ok\", \"value\": \"6\"}\\n' % i\n"
              "            os.write(fd, line.encode())\n"
              "        except OSError:\n"
              "            pass\n"
              "os._exit(0)\n")
    assert reward(forger, mode="pass_rate") == 0.0
    assert reward(forger, OPAQUE, mode="pass_rate") == 0.0


def test_truthiness_asserts_are_judged_in_the_harness_not_beside_the_program():
    spec = asserts_to_spec(["assert is_even(4)", "assert not is_even(3)", "assert is_even(2) == True"])
    assert spec.calls == () and len(spec.programs) == 3  # guessable expectations stay opaque
    answer = encode_tests(spec)
    assert reward("def is_even(n):\n    return n % 2 == 0", answer) == 1.0
    # bool() patched to always say True cannot pass "assert not ...": truthiness is decided elsewhere.
    assert reward("import builtins\nbuiltins.bool = lambda v: True\ndef is_even(n):\n    return 1", answer) == 0.0
    assert reward("def is_even(n):\n    return True", answer, mode="pass_rate") == pytest.approx(2 / 3)


def test_humaneval_check_function_becomes_value_checks_and_opaque_programs_still_run():
    program = ("METADATA = {'author': 'x'}\n\ndef check(candidate):\n    assert candidate([1, 2]) == 3\n"
               "    assert candidate([]) == 0\n    assert True, 'placeholder'\n")
    spec = asserts_to_spec(program, entry_point="total")
    assert [c[0] for c in spec.calls] == ["total([1, 2])", "total([])"] and not spec.programs
    assert reward("def total(xs):\n    return sum(xs)", encode_tests(spec)) == 1.0
    opaque = asserts_to_spec("def check(candidate):\n    for i in range(3):\n        assert candidate([i]) == i\n",
                             entry_point="total")
    assert opaque.programs and not opaque.calls
    assert reward("def total(xs):\n    return sum(xs)", encode_tests(opaque)) == 1.0
    assert reward("def total(xs):\n    return 0", encode_tests(opaque)) == 0.0
    assert reward("exit(0)", encode_tests(opaque)) == 0.0


def test_extract_program_prefers_the_last_python_block():
    text = "```\nnot this\n```\n```python\nx = 1\n```\n```py\ny = 2\n```"
    assert extract_program(text) == "y = 2"
    assert extract_program("```python\nz = 3\n") == "z = 3"  # unterminated last fence
    assert extract_program("   \n") is None


def test_malformed_tests_and_modes_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="not JSON"):
        code_tests_reward(GOOD_F, "#### 6")
    with pytest.raises(ValueError, match="code_mode"):
        make_code_reward("best_of")
    with pytest.raises(ValueError, match="at least one case"):
        encode_tests(Spec())


def test_reward_pool_scores_code_in_parallel():
    fn = make_code_reward("all_pass", case_timeout_s=2.0, sample_timeout_s=8.0)
    items = [(i, GOOD_F if i % 2 == 0 else "def f(x):\n    return -1", DIGIT_SUM) for i in range(6)]
    with RewardPool(fn, num_workers=2, timeout_s=15.0) as pool:
        results = pool.score_batch(items)
    assert [r.reward for r in results] == [1.0, 0.0] * 3
    assert all(r.status == "ok" for r in results)


IMPORTED = {  # solution -> how a judge that imports it as a module (stdin closed) sees add(1, 2) and add(5, 5)
    "main block reads input": ("def add(a, b):\n    return a + b\nif __name__ == '__main__':\n"
                               "    print(add(*map(int, input().split())))"),
    "main block runs an example": "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    assert add(2, 2) == 5",
    "top-level input": "def add(a, b):\n    return a + b\nx = input()",
    "plain": "def add(a, b):\n    return a + b",
}


@pytest.mark.parametrize("name", sorted(IMPORTED))
def test_call_cases_load_the_solution_as_an_imported_module(name, tmp_path):
    """The reference: a plain interpreter importing the solution as a module, its stdin empty. A main block does not
    run; input read at the top level fails the load, hence every case."""
    import subprocess
    import sys

    source = IMPORTED[name]
    (tmp_path / "solution.py").write_text(source)
    probe = "import solution\nprint(solution.add(1, 2), solution.add(5, 5))"
    plain = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=30)
    want = ("pass", "pass") if plain.returncode == 0 and plain.stdout.split() == ["3", "10"] else ("not_run",) * 2
    spec = Spec(calls=(("add(1, 2)", 3), ("add(5, 5)", 10)))
    assert run_tests(source, spec, mode="pass_rate").statuses == want
    opaque = Spec(programs=("assert add(1, 2) == 3 and add(5, 5) == 10",))
    assert run_tests(source, opaque).statuses == (want[:1] if want[0] == "pass" else ("not_run",))
    from areal_jax.rewards.code_feedback import code_feedback  # repair-turn feedback loads it the same way

    assert code_feedback(f"```python\n{source}\n```", encode_tests(spec), cases=2)[0] == (want[0] == "pass")
