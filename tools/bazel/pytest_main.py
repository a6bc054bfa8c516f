"""Main of BUILD's py_test targets: `bazel test //:test_rl_losses` runs pytest on that test file.

Bazel runs a py_test's main as a script, which would only import a pytest file and pass without running a
test; this hands the file (BUILD passes it as the argument) to pytest instead. Run from the runfiles tree,
where only the target's srcs and deps exist, so a test passing here also shows BUILD's deps are enough.
"""
import sys

import pytest

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: pytest_main.py TEST_FILE [PYTEST_ARGS...]: name the test file to run")
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
