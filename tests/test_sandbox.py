"""Sandboxed code execution: hostile programs are contained and return promptly; code_reward."""

import os
import signal
import socket
import threading
import time
import uuid

import pytest

from areal_jax.rewards.sandbox import (
    code_reward,
    extract_python_code,
    namespace_isolation,
    run_python_sandboxed,
)

HAS_PID_NS = "--pid" in namespace_isolation()
HAS_NET_NS = "--net" in namespace_isolation()


def _run(code, **kw):
    kw.setdefault("timeout_s", 3.0)
    t0 = time.monotonic()
    result = run_python_sandboxed(code, **kw)
    return result, time.monotonic() - t0


def test_ordinary_program_with_stdin_imports_and_local_files():
    code = ("import collections, json, math, fractions\n"
            "data = input().split()\n"
            "open('scratch.txt', 'w').write(' '.join(reversed(data)))\n"
            "print(open('scratch.txt').read(), math.comb(5, 2))\n")
    result, _ = _run(code, stdin="a b c\n")
    assert result.status == "ok" and result.exit_code == 0, result.stderr
    assert result.stdout == "c b a 10\n"


def test_installed_packages_import_but_no_pth_hook_runs():
    """The child starts without ``site`` (-S): the installation's .pth files (an editable install's import finder,
    for one) run no code in the sandbox, while a pure-Python package installed the ordinary way still imports
    (numpy does not: it needs ctypes, which the audit hook denies)."""
    import importlib.util
    import sysconfig

    purelib = os.path.realpath(sysconfig.get_paths()["purelib"])
    installed = [name for name in ("packaging", "idna", "six", "pluggy", "iniconfig")
                 if (spec := importlib.util.find_spec(name)) and spec.origin
                 and os.path.realpath(spec.origin).startswith(purelib + os.sep)]
    assert installed, "no ordinary pure-Python package found in site-packages"
    code = ("import sys\n"
            "assert sys.flags.no_site and 'site' not in sys.modules, sorted(sys.modules)\n"
            "finders = [type(f).__name__ for f in sys.meta_path]\n"
            "assert not any('editable' in f.lower() for f in finders), finders\n"
            f"import {installed[0]}\n"
            f"print({installed[0]}.__name__)\n")
    result, _ = _run(code, timeout_s=20.0)
    assert result.status == "ok", result.stderr
    assert result.stdout == f"{installed[0]}\n"


def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    result, elapsed = _run("while True:\n    pass\n", timeout_s=1.5)
    assert result.status == "timeout" and result.timed_out
    assert 1.4 <= elapsed < 5.0


def test_fork_bomb_is_denied():
    result, elapsed = _run("import os\nwhile True:\n    os.fork()\n")
    assert result.status == "error" and "os.fork" in result.stderr
    assert elapsed < 3.0


@pytest.mark.parametrize("code", [
    "print(open('/etc/passwd').read())",
    "import pathlib\nprint(pathlib.Path('/etc/hostname').read_text())",
    "print(open('../outside.txt', 'w'))",
    "import os\nprint(os.listdir('/root'))",
    "import os\nos.symlink('/etc/passwd', 'link')\nprint(open('link').read())",
])
def test_files_outside_the_working_directory_are_denied(code):
    result, elapsed = _run(code)
    assert result.status == "error" and "PermissionError" in result.stderr
    assert "root:" not in result.stdout
    assert elapsed < 3.0


def test_sockets_are_denied():
    result, _ = _run("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))\n")
    assert result.status == "error" and "network access" in result.stderr


def test_printing_100_mb_is_cut_off():
    code = "import sys\nfor _ in range(1_000_000):\n    sys.stdout.write('x' * 100)\n"
    result, elapsed = _run(code, max_output_bytes=1 << 20, timeout_s=20)
    assert result.status == "output_limit" and result.output_truncated
    assert len(result.stdout) + len(result.stderr) <= 1 << 20
    assert elapsed < 5.0


def test_allocating_10_gb_fails_inside_the_child():
    result, elapsed = _run("x = bytearray(10 * 1024 ** 3)\n", memory_mb=256)
    assert result.status == "error" and "MemoryError" in result.stderr
    assert elapsed < 3.0


def test_cpu_time_limit_stops_a_busy_loop_before_the_wall_clock():
    result, elapsed = _run("while True:\n    pass\n", timeout_s=20, cpu_time_s=1)
    assert result.status == "error" and result.exit_code != 0
    assert elapsed < 5.0


def test_killing_the_parent_and_raising_limits_are_denied():
    for code in ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
                 "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n",
                 "import ctypes\n",
                 "import subprocess\nsubprocess.run(['true'])\n"):
        result, _ = _run(code)
        assert result.status == "error" and "PermissionError" in result.stderr, code


@pytest.mark.skipif(not HAS_NET_NS, reason="unshare --net is not available on this host")
def test_network_namespace_holds_without_the_audit_hook():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(1.0)
    port = server.getsockname()[1]
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(_try_accept(server)))
    t.start()
    code = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "print('CONNECTED')\n")
    result, _ = _run(code, audit_hook=False)
    t.join()
    server.close()
    assert "CONNECTED" not in result.stdout and result.status == "error"
    assert accepted == [False]


def _try_accept(server):
    try:
        server.accept()[0].close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not HAS_PID_NS, reason="unshare --pid is not available on this host")
def test_processes_that_leave_the_group_die_with_the_sandbox():
    marker = f"sandbox-escape-{uuid.uuid4().hex}"
    code = ("import os, sys, time\n"
            "for _ in range(4):\n"
            "    if os.fork() == 0:\n"
            "        os.setsid()\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', "
            f"'{marker}'])\n"
            "print('forked', flush=True)\n"
            "time.sleep(600)\n")
    # The PID namespace alone: the layers that would stop the forks and execs (audit hook, seccomp, Landlock) are off.
    result, elapsed = _run(code, audit_hook=False, allow_subprocess=True, landlock=False, timeout_s=1.5)
    assert result.status == "timeout" and elapsed < 5.0
    assert result.stdout == "forked\n"  # the escapees really were started
    time.sleep(0.3)
    left = _pids_with_marker(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left


def _pids_with_marker(marker: str) -> list[int]:
    """Processes whose command line contains marker, from /proc/*/cmdline."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_working_directory_is_fresh_and_removed():
    result, _ = _run("import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\n")
    cwd, listing = result.stdout.splitlines()
    assert listing == "['main.py']"
    assert not os.path.exists(cwd)


def test_extract_python_code_takes_the_last_python_block():
    text = ("```python\nx = 1\n```\nthen\n```text\nnot code\n```\n"
            "```py\ndef f(a):\n    return a + 1\n```\ntrailing words")
    assert extract_python_code(text) == "def f(a):\n    return a + 1\n"
    assert extract_python_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_python_code("no code") is None


def test_code_reward():
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
    assert code_reward(good, tests) == 1.0
    assert code_reward(good, "assert add(2, 2) == 4") == 1.0
    assert code_reward(bad, tests) == 0.0
    assert code_reward("def add(a, b): return a + b", tests) == 0.0  # no fenced block
    t0 = time.monotonic()
    assert code_reward("```python\nwhile True: pass\n```", tests, timeout_s=1.0) == 0.0
    assert time.monotonic() - t0 < 4.0
    assert code_reward(None, tests) == 0.0


def test_invalid_limits_raise_a_clear_error():
    with pytest.raises(ValueError, match="positive limits"):
        run_python_sandboxed("print(1)", timeout_s=0)
