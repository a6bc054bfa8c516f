"""Hidden test cases of a programming task: their JSON form, and turning assert tests into value checks.

A task's tests travel through the data pipeline as the example's ``answer`` string (never in the prompt):

    {"format": "code_tests/1", "setup": "", "stdio": [[input, output], ...]}          # APPS / TACO stdin
    {"format": "code_tests/1", "setup": "", "calls": [[expr, expected_json], ...]}    # call-based / asserts
    {"format": "code_tests/1", "setup": "", "programs": [src, ...]}                   # opaque assert code

A stdin task may also name how its outputs are compared, ``"output_match": "lines" | "tokens" | "numbers"``
(``outputs_match``); without it the reward's own setting (``reward.code_output_match``) applies. A task may carry
its contest's time limit per case, ``"time_limit_s"``, which the reward applies when ``reward.code_time_limit_factor``
is set. A stdin task whose right outputs are many (any valid order, any shortest path) carries a special judge,
``"checker"``: Python source run for each case as ``checker.py input.txt correct_output.txt solution_output.txt`` in a
directory holding those three files (the contract of the checkers of open-r1/codeforces, ``generated_checker``); the
case passes when the checker exits with status 0 and the last token it prints is ``1``.

A "calls" case is an expression such as ``"f(123)"`` and the expected value as JSON text (tuples become
lists); the program's own process evaluates it and returns the value's ``repr``, and the comparison
happens outside the sandbox, so a program cannot pass without computing the right values. Assert tests
of the form ``assert <expr> == <literal>`` (also ``<literal> == <expr>``, and the same inside HumanEval's
``def check(candidate)``) are rewritten into calls, unless the literal is True, False or None: a value a
program could guess while it rebinds the names the expression uses (``assert isclose(f(2), 4.0) ==
True`` with its own ``isclose``). Anything else, ``assert <call>`` included, stays an opaque program,
judged by the sandbox's harness process, which calls the program only through plain-value proxies.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from typing import Any, Sequence

__all__ = ["TestSpec", "encode_tests", "parse_tests", "asserts_to_spec", "values_equal",
           "outputs_match", "TESTS_FORMAT", "OUTPUT_MATCHES", "CALL_PRELUDE"]

TESTS_FORMAT = "code_tests/1"
# What LeetCode-style judges give a function-call solution without its importing it (the signatures of LeetCode,
# LiveCodeBench and TACO's call-based tasks use List / Optional, and their solutions Counter, deque, heappush, bisect,
# lru_cache, gcd, inf, ...): the setup of such tasks (data/code_readers.py). The math names are listed one by one so
# that the builtin pow (three-argument modular pow) is not shadowed by math.pow.
CALL_PRELUDE = (
    "from typing import *\n"
    "from collections import *\n"
    "from itertools import *\n"
    "from functools import *\n"
    "from heapq import *\n"
    "from bisect import *\n"
    "from math import (inf, nan, pi, e, sqrt, isqrt, gcd, lcm, ceil, floor, log, log2, log10, exp, factorial, comb, perm,\n"
    "                  prod, fsum, hypot, sin, cos, tan, atan2, isclose, isinf, isnan, trunc)\n"
    "import bisect, collections, copy, functools, heapq, itertools, math, operator, random, re, string, sys\n"
)
TRUTH_KEY = "__truth__"  # expected {"__truth__": b}: the value's truthiness must be b (hand-made specs)
OUTPUT_MATCHES = ("lines", "tokens", "numbers")
DEFAULT_OUTPUT_MATCH = "numbers"
_REAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][+-]?\d+)?")
_SAFE_WRAPPERS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "sorted": sorted}


@dataclasses.dataclass(frozen=True)
class TestSpec:
    """One task's hidden tests: exactly one of stdio / calls / programs is non-empty for data readers.

    stdio: (stdin text, expected stdout text) pairs.
    calls: (expression source, expected value) pairs; expected is any JSON-like value.
    programs: opaque test programs executed after the solution (pass = no exception).
    setup: code run before the solution (MBPP's test_setup_code, e.g. imports).
    output_match: how stdio outputs are compared (OUTPUT_MATCHES); "" leaves it to the reward's setting.
    time_limit_s: the task's own time limit per case (its contest's), 0 for none.
    checker: Python source of a special judge for the stdio cases (module doc); "" compares outputs.
    """
    __test__ = False  # a test suite's collector takes it for a test class by its name
    stdio: tuple[tuple[str, str], ...] = ()
    calls: tuple[tuple[str, Any], ...] = ()
    programs: tuple[str, ...] = ()
    setup: str = ""
    output_match: str = ""
    time_limit_s: float = 0.0
    checker: str = ""

    def __post_init__(self) -> None:
        if self.checker and not self.stdio:
            raise ValueError("a checker judges stdin/stdout cases; these tests have none.")
        if self.output_match and self.output_match not in OUTPUT_MATCHES:
            raise ValueError(f"output_match={self.output_match!r} is not one of {', '.join(OUTPUT_MATCHES)}.")
        if not (math.isfinite(self.time_limit_s) and self.time_limit_s >= 0):
            raise ValueError(f"time_limit_s={self.time_limit_s} must be a finite number of seconds >= 0 (0: none).")

    @property
    def num_cases(self) -> int:
        return len(self.stdio) + len(self.calls) + len(self.programs)


def encode_tests(spec: TestSpec) -> str:
    """The JSON text of ``spec`` (the ``answer`` field of a code PromptExample)."""
    if spec.num_cases == 0:
        raise ValueError("a test spec needs at least one case (stdio, call or program).")
    out: dict[str, Any] = {"format": TESTS_FORMAT, "setup": spec.setup}
    if spec.stdio:
        out["stdio"] = [list(pair) for pair in spec.stdio]
    if spec.calls:
        out["calls"] = [[src, json.dumps(_jsonable(v))] for src, v in spec.calls]
    if spec.programs:
        out["programs"] = list(spec.programs)
    if spec.output_match:
        out["output_match"] = spec.output_match
    if spec.time_limit_s:
        out["time_limit_s"] = spec.time_limit_s
    if spec.checker:
        out["checker"] = spec.checker
    return json.dumps(out)


def parse_tests(text: str) -> TestSpec:
    """Inverse of encode_tests; ValueError for anything else."""
    try:
        data = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"the tests are not JSON ({e}); code rewards need data.task='code' readers.") from None
    if not isinstance(data, dict) or data.get("format") != TESTS_FORMAT:
        raise ValueError(f"the tests are not in the {TESTS_FORMAT} layout.")
    stdio = tuple((str(i), str(o)) for i, o in data.get("stdio", []))
    calls = tuple((str(src), json.loads(expected)) for src, expected in data.get("calls", []))
    spec = TestSpec(stdio=stdio, calls=calls, programs=tuple(map(str, data.get("programs", []))),
                    setup=str(data.get("setup", "")), output_match=str(data.get("output_match", "")),
                    time_limit_s=float(data.get("time_limit_s", 0.0)), checker=str(data.get("checker", "")))
    if spec.num_cases == 0:
        raise ValueError("the tests hold no case.")
    return spec


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return {"__set__": sorted((_jsonable(v) for v in value), key=repr)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _jsonable(v) for k, v in value.items()}
        return {"__dict__": [[_jsonable(k), _jsonable(v)] for k, v in value.items()]}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, complex):
        return {"__complex__": [value.real, value.imag]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"expected value of type {type(value).__name__} cannot be stored in the tests.")


def _normalise(value: Any) -> Any:
    """A value as _jsonable would store it, then read back: tuples are lists, sets tagged."""
    return json.loads(json.dumps(_jsonable(value)))


def values_equal(got: Any, expected: Any, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Python equality of two stored values, floats within a tolerance, lists and tuples alike."""
    if isinstance(expected, dict) and set(expected) == {TRUTH_KEY}:
        return bool(got) == bool(expected[TRUTH_KEY])
    got, expected = _normalise(got), _normalise(expected)
    return _equal(got, expected, rel_tol, abs_tol)


def _equal(a: Any, b: Any, rel_tol: float, abs_tol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y, rel_tol, abs_tol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], rel_tol, abs_tol) for k in a)
    return type(a) is type(b) and a == b


def outputs_match(got: str, expected: str, mode: str = "") -> bool:
    """Whether a program's standard output ``got`` passes for ``expected``, compared as ``mode`` says ("" is
    DEFAULT_OUTPUT_MATCH, "numbers"):

    "lines": line by line, ignoring trailing whitespace on each line, trailing blank lines and \\r\\n against \\n;
    "tokens": the whitespace-separated tokens are the same (how a contest's default checker reads an output);
    "numbers": "tokens", except that where the expected token is a real number (a decimal point or an exponent) any
      number within an absolute or relative error of 1e-6 passes, |got - expected| <= 1e-6 * max(1, |expected|)
      (what problems with real-valued answers accept), and a YES / NO answer in any case ("Yes" for "YES", as the
      contests' standard yes/no checker reads it); integers and other words must still match exactly.
    """
    mode = mode or DEFAULT_OUTPUT_MATCH
    if mode == "lines":
        def lines(text: str) -> list[str]:
            out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
            while out and not out[-1]:
                out.pop()
            return out
        return lines(got) == lines(expected)
    if mode not in OUTPUT_MATCHES:
        raise ValueError(f"output_match={mode!r} is not one of {', '.join(OUTPUT_MATCHES)}.")
    got_tokens, expected_tokens = got.split(), expected.split()
    if len(got_tokens) != len(expected_tokens):
        return False
    return all(a == b or (mode == "numbers" and (_close_reals(a, b) or _same_yes_no(a, b)))
               for a, b in zip(got_tokens, expected_tokens))


def _same_yes_no(got: str, expected: str) -> bool:
    return expected.upper() in ("YES", "NO") and got.upper() == expected.upper()


def _close_reals(got: str, expected: str) -> bool:
    if not _REAL.fullmatch(expected):
        return False
    try:
        a, b = float(got), float(expected)
    except ValueError:
        return False
    return math.isfinite(a) and abs(a - b) <= 1e-6 * max(1.0, abs(b))


def _literal(node: ast.AST) -> tuple[bool, Any]:
    """(True, value) when ``node`` is a literal or set/frozenset/tuple/list/sorted of one."""
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SAFE_WRAPPERS
            and len(node.args) == 1 and not node.keywords):
        ok, inner = _literal(node.args[0])
        if ok:
            try:
                return True, _SAFE_WRAPPERS[node.func.id](inner)
            except TypeError:
                return False, None
    return False, None


def _assert_to_call(stmt: ast.stmt) -> tuple[str, Any] | None:
    """("expr source", expected) for a rewritable assert statement, else None."""
    if not isinstance(stmt, ast.Assert):
        return None
    test = stmt.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        left, right = test.left, test.comparators[0]
        for literal, expr in ((right, left), (left, right)):
            ok, value = _literal(literal)
            if ok and not _literal(expr)[0]:
                # A guessable expected value stays opaque (the program controls the expression's names).
                return None if value is None or isinstance(value, bool) else (ast.unparse(expr), value)
    return None


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(id=self.new, ctx=node.ctx), node) if node.id == self.old else node


def _check_function_calls(tree: ast.Module, entry_point: str) -> list[tuple[str, Any]] | None:
    """HumanEval layout: literal assignments plus ``def check(candidate)`` whose body is rewritable
    asserts. Returns the calls with ``candidate`` renamed to ``entry_point``, or None."""
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    others = [n for n in tree.body if n not in checks]
    if len(checks) != 1 or len(checks[0].args.args) != 1:
        return None
    if any(not (isinstance(n, ast.Assign) and _literal(n.value)[0]) for n in others):
        return None
    param = checks[0].args.args[0].arg
    calls = []
    for stmt in checks[0].body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant) and stmt.test.value is True:
            continue  # HumanEval's no-op "assert True, 'message'" lines test nothing
        renamed = _Rename(param, entry_point).visit(stmt)
        call = _assert_to_call(renamed)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def asserts_to_spec(tests: Sequence[str] | str, *, setup: str = "", entry_point: str | None = None) -> TestSpec:
    """A TestSpec from assert tests: a list of assert statements (MBPP ``test_list``), or one test
    program (HumanEval ``test`` with ``entry_point``, run as ``check(entry_point)`` when opaque).

    Each rewritable assert becomes a call case; when any statement of a list is not rewritable, that
    statement alone becomes an opaque program. Raises ValueError for source that does not parse.
    """
    if isinstance(tests, str):
        try:
            tree = ast.parse(tests)
        except SyntaxError as e:
            raise ValueError(f"the test program does not parse: {e.msg} (line {e.lineno})") from None
        if entry_point is not None:
            calls = _check_function_calls(tree, entry_point)
            if calls is not None:
                return TestSpec(calls=tuple(calls), setup=setup)
            return TestSpec(programs=(f"{tests}\n\ncheck({entry_point})\n",), setup=setup)
        statements = [ast.unparse(s) for s in tree.body]
    else:
        statements = list(tests)
    calls, programs = [], []
    for source in statements:
        try:
            tree = ast.parse(source)
        except SyntaxError as e:
            raise ValueError(f"the test {source!r:.80} does not parse: {e.msg}") from None
        call = _assert_to_call(tree.body[0]) if len(tree.body) == 1 else None
        if call is None:
            programs.append(source)
        else:
            calls.append(call)
    return TestSpec(calls=tuple(calls), programs=tuple(programs), setup=setup)
