"""Final-answer extraction, math equality (math-verify + numeric fast path) and exact match."""

import subprocess
import sys
import threading
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_jax.rewards import exact_match_reward, extract_final_answer, math_reward
from areal_jax.rewards.exact import normalize_answer
from areal_jax.rewards.math import parse_plain_number, reference_answer


@pytest.mark.parametrize("text, expected", [
    # last balanced \boxed{} wins, nested braces kept
    (r"first \boxed{1} then \boxed{\frac{1}{2}} done", r"\frac{1}{2}"),
    (r"\boxed{a_{1}+b} and a truncated \boxed{\frac{3}{", "a_{1}+b"),
    # boxed beats #### and "the answer is"
    (r"The answer is 4. #### 5 \boxed{6}", "6"),
    # GSM8K: the rest of the line after the last ####
    ("57+5=62. 62-6=56.\n#### 56", "56"),
    ("#### 3\nmore work\n#### 1,234\nExplanation follows", "1,234"),
    # "the answer is", case-insensitive, sentence end cut, decimals kept
    ("So THE ANSWER IS 3.5. Let me double check.", "3.5"),
    ("Thus the final answer is: $\\frac{2}{3}$.", "$\\frac{2}{3}$"),
    # last number
    ("I have 3 apples and -12 pears, total 1,000 things.", "1,000"),
    ("x = 3/4 of the cake", "3/4"),
    ("a list 1,2345 then", "2345"),
    ("costs 0.75 or .5", ".5"),
    ("step2 has nothing", None),
    ("no digits here", None),
    ("", None),
])
def test_extract_final_answer_by_hand(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("#### 72", "72", 1.0),
    ("#### 72", "73", 0.0),
    ("The total is 1,000 dollars.", "1000", 1.0),
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"so \boxed{0.5}", r"\frac{1}{2}", 1.0),
    ("the answer is 1/2.", "0.5", 1.0),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs. 9 * 2 = 18.\n#### 18", 1.0),
    ("no answer here", "3", 0.0),
    (r"\boxed{\frac{1}{0}}", "1", 0.0),
    (r"\boxed{\invalid{{", "1", 0.0),
    # a number and its unit against a plain reference: the number is the answer; anything more is not
    ("#### 12 dollars", "12", 1.0),
    (r"\boxed{12 dollars}", "12", 1.0),
    ("The answer is $12.50 per hour.", "12.5", 1.0),
    (r"#### 40\%", "40", 1.0),
    ("#### 1,200 people's votes", "1200", 1.0),
    ("#### 12 dollars", "13", 0.0),
    ("#### 3 and 4", "3", 0.0),
    ("#### 12 x 3", "12", 0.0),
    # how instruct models dress a number: markdown emphasis, LaTeX's escaped dollar and thousands spacing
    ("The answer is **42**.", "42", 1.0),
    ("The answer is **42**.", "43", 0.0),
    (r"\boxed{\$18}", "18", 1.0),
    (r"the answer is \$18.", "18", 1.0),
    (r"\boxed{\$18.00}", "18", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{1\,000}", "1000", 1.0),
    ("#### 1\u202f000", "1000", 1.0),
    ("The answer is **\\$12.50 per hour**.", "12.5", 1.0),
])
def test_math_reward_by_hand(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_math_reward_never_raises_on_odd_inputs():
    for completion, answer in [(None, "1"), ("1", None), (b"1", "1"), (r"\boxed{" * 50, "1"),
                               ("9" * 5000, "9" * 5000), (r"\boxed{\frac{}{}}", r"\frac{}{}")]:
        assert math_reward(completion, answer) in (0.0, 1.0)


@given(n=st.integers(-10**9, 10**9), style=st.sampled_from(["plain", "comma", "decimal", "boxed",
                                                           "frac", "answer_is"]))
@settings(max_examples=60, deadline=None)
def test_equivalent_spellings_of_an_integer_score_one_and_neighbours_zero(n, style):
    spelled = {
        "plain": f"#### {n}",
        "comma": f"#### {n:,}",
        "decimal": f"#### {n}.0",
        "boxed": rf"\boxed{{{n}}}",
        "frac": rf"\boxed{{\frac{{{2 * n}}}{{2}}}}",
        "answer_is": f"The answer is {n}.",
    }[style]
    assert math_reward(spelled, str(n)) == 1.0
    assert math_reward(spelled, str(n + 1)) == 0.0


@pytest.mark.parametrize("text, value", [
    ("1,000", Fraction(1000)), ("-3", Fraction(-3)), ("0.5", Fraction(1, 2)), ("$72$", Fraction(72)),
    ("3/4", Fraction(3, 4)), (".25", Fraction(1, 4)), ("72.", Fraction(72)), ("1/0", None),
    (r"\frac{1}{2}", None), ("3 apples", None), ("1,2", None), ("1e5", None),
])
def test_parse_plain_number(text, value):
    assert parse_plain_number(text) == value


def test_integer_fast_path_does_not_import_sympy():
    code = ("import sys\nfrom areal_jax.rewards.math import math_reward\n"
            "assert math_reward('so #### 1,234', '1234') == 1.0\n"
            "assert math_reward('the answer is 0.5', '1/2') == 1.0\n"
            "assert math_reward('#### 5', '6') == 0.0\n"
            "print('sympy' in sys.modules, 'math_verify' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_latex_comparison_works_off_the_main_thread():
    # math-verify's own timeouts use signals, which fail outside the main thread.
    results = []
    t = threading.Thread(target=lambda: results.append(
        (math_reward(r"\boxed{\frac{1}{2}}", "0.5"), math_reward(r"\boxed{\frac{1}{3}}", "0.5"))))
    t.start()
    t.join(timeout=60)
    assert results == [(1.0, 0.0)]


def test_reference_answer_reduces_full_solutions_only():
    assert reference_answer("work...\n#### 1,000") == "1,000"
    assert reference_answer(r"so \boxed{7}") == "7"
    assert reference_answer(r" \frac{1}{2} ") == r"\frac{1}{2}"


@pytest.mark.parametrize("text, expected", [
    (" $\\text{Paris}$. ", "paris"), ("1,000,000", "1000000"), ("New   York", "new york"),
    ("(1,2)", "(1,2)"), ("B", "b"),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    (r"\boxed{\text{Paris}}", "paris", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("the answer is B.", "b", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 0.0),  # exact match is string-level, unlike math_reward
    ("#### 7", "8", 0.0),
    ("nothing", "8", 0.0),
    (None, "8", 0.0),
])
def test_exact_match_reward(completion, answer, expected):
    assert exact_match_reward(completion, answer) == expected
