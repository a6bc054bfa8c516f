"""Programs that try to pass hidden tests without computing anything: each must score 0 against tests of
f(x) = the sum of the digits of x (tests/test_code_rewards.py, tests/test_reliability_untrusted.py).

Keys describe the hack; values are program texts (what a completion's ```python block would hold).
"""
from __future__ import annotations

__all__ = ["HOSTILE_PROGRAMS"]

HOSTILE_PROGRAMS: dict[str, str] = {
    "prints nothing": "pass",
    "exit(0)": "exit(0)",
    "sys.exit at import": "import sys\nsys.exit(0)",
    "os._exit(0)": "import os\nos._exit(0)",
    "SystemExit inside the tested function": "def f(x):\n    raise SystemExit(0)",
    "os._exit inside the tested function": "import os\ndef f(x):\n    os._exit(0)",
    "object equal to everything": ("class Any:\n    def __eq__(self, other):\n        return True\n"
                                   "    __hash__ = None\ndef f(x):\n    return Any()"),
    "int subclass equal to everything": ("class I(int):\n    def __eq__(self, other):\n        return True\n"
                                         "def f(x):\n    return I(-1)"),
    "patched builtins": ("import builtins\nbuiltins.AssertionError = type('E', (BaseException,), {})\n"
                         "builtins.repr = lambda v: '6'\nbuiltins.isinstance = lambda *a: True\n"
                         "def f(x):\n    return -1"),
    "harness file edited": ("open('main.py', 'w').write('print(1)')\ndef f(x):\n    return -1"),
    "forged report without the nonce": ("import os\n"
                                        "os.write(1, b'x {\"i\": 0, \"status\": \"ok\", \"value\": \"6\"}\\n')\n"
                                        "os._exit(0)"),
    "stdout replaced": "import sys, io\nsys.stdout = io.StringIO()\ndef f(x):\n    return -1",
    "json encoder patched": ("import json\nclass E(json.JSONEncoder):\n    def encode(self, o):\n"
                             "        ok = '{\"i\": 0, \"status\": \"ok\", \"value\": \"6\"}'\n"
                             "        return ok if 'i' in o else super().encode(o)\n"
                             "json._default_encoder = E()\ndef f(x):\n    return -1"),
    "AssertionError patched in builtins and sys": ("import builtins, sys\n"
                                                   "builtins.AssertionError = type('E', (BaseException,), {})\n"
                                                   "sys.excepthook = lambda *a: None\ndef f(x):\n    return -1"),
    "check() predefined": ("def check(candidate):\n    pass\ndef f(x):\n    return -1"),
    "harness files and modules planted": ("for m in ('json', 'ast', 'importlib', 'math', 'os'):\n"
                                          "    open(m + '.py', 'w').write('raise SystemExit(0)')\n"
                                          "import math\ndef f(x):\n    return -1"),
}
