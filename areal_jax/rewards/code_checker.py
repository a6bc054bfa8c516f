"""Special judges: a task's checker program decides whether a stdin case's output is right (``TestSpec.checker``).

Some problems accept many outputs (any valid order, any shortest path); their tests carry the expected output of one
reference solution and a checker, Python source run as ``checker.py input.txt correct_output.txt solution_output.txt``
in a directory holding those three files. The case passes when the checker exits with status 0 and the last token it
prints is ``1`` (the checkers of open-r1/codeforces, ``generated_checker``, follow this contract).

The checker runs in the sandbox as a program would, never beside the candidate: once the candidate's outputs are in,
the checker runs once per case with the case's input, expected and actual output as its standard input
(``checker_program`` wraps it so it finds them as the three files), through the same runners as the candidate (one
sandboxed runner forking a process per case, or a fresh sandboxed interpreter per case). So a checker that hangs,
crashes or floods its output costs that case, and nothing a candidate printed can reach the checker but as the file
``solution_output.txt``. A checker that does not exit 0 rejects the case.
"""
from __future__ import annotations

import json

__all__ = ["CHECKER_ARGV", "checker_program", "checker_accepts", "checker_stdin"]

CHECKER_ARGV = ("checker.py", "input.txt", "correct_output.txt", "solution_output.txt")


def checker_program(checker: str) -> str:
    """The program that runs ``checker`` for one case: it reads the case as JSON [input, expected, actual] from its
    standard input, writes the three files into its directory, sets ``sys.argv`` to ``CHECKER_ARGV`` and its standard
    input to the input file, and runs the checker as ``__main__``."""
    return (
        "import json as _json, sys as _sys\n"
        "_case = _json.loads(_sys.stdin.read())\n"
        f"for _name, _text in zip({CHECKER_ARGV[1:]!r}, _case):\n"
        "    with open(_name, 'w', encoding='utf-8') as _f:\n"
        "        _f.write(_text)\n"
        f"_sys.argv = {list(CHECKER_ARGV)!r}\n"
        f"_sys.stdin = open({CHECKER_ARGV[1]!r}, encoding='utf-8')\n"
        f"_source = {checker!r}\n"
        "del _case, _name, _text, _f, _json\n"
        "exec(compile(_source, 'checker.py', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})\n"
    )


def checker_stdin(stdin: str, expected: str, actual: str) -> str:
    """The checker program's standard input for one case."""
    return json.dumps([stdin, expected, actual])


def checker_accepts(status: str, stdout: str) -> bool:
    """The verdict of one checker run: it ended normally (exit status 0) and its last printed token is ``1``."""
    tokens = stdout.split()
    return status == "ok" and bool(tokens) and tokens[-1] == "1"
