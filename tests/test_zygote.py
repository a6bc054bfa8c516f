"""rewards.zygote: sandboxed runs forked from a long-lived sandboxed process give what a fresh sandbox gives, start from
a pristine state every time, leave nothing running, and survive the zygote's death."""
import os
import signal
import time

import pytest

from areal_jax.rewards.sandbox import run_python_sandboxed
from areal_jax.rewards.zygote import SandboxZygote, run_forked

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

BATTERY = {
    "prints": ("print('hi')\nprint(2 + 2)", ""),
    "echoes stdin": ("import sys\nprint(sys.stdin.read()[::-1])", "abc\n"),
    "unicode": ("print('ñ → λ')", ""),
    "raises": ("raise ValueError('x')", ""),
    "exit code": ("import sys\nprint(1)\nsys.exit(7)", ""),
    "exit(0) early": ("import sys\nsys.exit(0)\nprint('never')", ""),
    "hangs": ("while True:\n    pass", ""),
    "floods stdout": ("print('x' * 3_000_000)", ""),
    "opens a socket": ("import socket\nsocket.socket()", ""),
    "writes outside": ("open('/tmp/areal_zygote_escape', 'w').write('x')", ""),
    "imports ctypes": ("import ctypes", ""),
}


@pytest.mark.parametrize("name", sorted(BATTERY))
def test_a_forked_run_gives_what_a_fresh_sandbox_gives(name):
    code, stdin = BATTERY[name]
    forked = run_forked(code, stdin=stdin, timeout_s=1.5)
    fresh = run_python_sandboxed(code, stdin=stdin, timeout_s=1.5, allow_subprocess=True)
    assert (forked.status, forked.stdout) == (fresh.status, fresh.stdout)
    if fresh.status in ("ok", "error"):
        assert forked.exit_code == fresh.exit_code
    assert not os.path.exists("/tmp/areal_zygote_escape")


def test_every_run_starts_from_the_pristine_state():
    spoil = ("import builtins, json, sys\nbuiltins.len = lambda x: -1\njson.dumps = None\nsys.modules['evil'] = 1\n"
             "global_counter = 41\nopen('left_behind', 'w').write('x')\nprint('spoiled')")
    check = ("import builtins, json, os, sys\n"
             "print(len('ab'), json.dumps([1]), 'evil' in sys.modules, 'global_counter' in globals(), "
             "os.path.exists('left_behind'), os.path.exists('../left_behind'))")
    assert run_forked(spoil).stdout == "spoiled\n"
    assert run_forked(check).stdout == "2 [1] False False False False\n"


def test_a_run_can_write_only_in_its_own_directory():
    out = run_forked("import os\nopen('mine', 'w').write('ok')\nprint(open('mine').read())\n"
                     "for target in ('../theirs', '/tmp/theirs'):\n"
                     "    try:\n        open(target, 'w')\n        print('wrote', target)\n"
                     "    except PermissionError:\n        print('refused', target)")
    assert out.status == "ok" and out.stdout == "ok\nrefused ../theirs\nrefused /tmp/theirs\n"


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        found.update(kids)
        todo.extend(kids)
    return found


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"), reason="needs /proc")
def test_nothing_a_run_started_outlives_it():
    zygote = SandboxZygote()
    try:
        assert zygote.run("print('up')").stdout == "up\n"
        before = _descendants(zygote._proc.pid)  # the zygote (under unshare when namespaces are available)
        assert before or zygote._proc.poll() is None
        code = "import os\nif os.fork() == 0:\n    while True:\n        pass\nprint('left a child running', flush=True)"
        result = zygote.run(code, timeout_s=1.0)
        assert result.stdout == "left a child running\n"  # then the child held the pipe until the time limit
        time.sleep(0.2)
        assert _descendants(zygote._proc.pid) == before
        assert zygote.run("print('next')").stdout == "next\n"
    finally:
        zygote.close()


def test_a_dead_zygote_is_replaced():
    assert run_forked("print(1)").stdout == "1\n"
    from areal_jax.rewards import zygote as module

    key = (512, False)  # run_forked's defaults: memory_mb, allow_numpy (other tests may hold other zygotes)
    current = module._LOCAL.zygotes[key]
    os.killpg(current._proc.pid, signal.SIGKILL)
    current._proc.wait()
    assert run_forked("print(2)").stdout == "2\n"  # a new zygote took the run
    assert module._LOCAL.zygotes[key] is not current


def test_stop_when_ends_a_forked_run():
    code = "import time\nprint(1, flush=True)\nprint(2, flush=True)\ntime.sleep(60)\nprint(3)"
    seen = []
    result = run_forked(code, timeout_s=90, stop_when=lambda piece: seen.append(piece) or b"2\n" in b"".join(seen))
    assert result.status == "stopped" and result.stdout.startswith("1\n2\n") and result.seconds < 30
    assert run_forked("print('after')").stdout == "after\n"


def test_each_run_has_its_own_cpu_limit_and_cannot_raise_it():
    out = run_forked("import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU))", timeout_s=3.0)
    assert out.stdout == "(5, 6)\n"  # the run's wall limit + 2 s, counted from its fork
    raise_it = run_forked("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6))", timeout_s=3.0)
    assert raise_it.status == "error" and "resource.setrlimit is not allowed" in raise_it.stderr
    spin = run_forked("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, 2))\nwhile True:\n    pass",
                      timeout_s=30.0)  # lowering is allowed, and the kernel holds a run to its CPU limit
    assert spin.status == "error" and spin.seconds < 20
