"""The kernel's rules in the sandbox: Landlock holds the file, execve, TCP and signal rules and a seccomp filter the
no-new-processes rule even when a program switches the audit hook off. Each attack is run twice, with the layer and
without it (the reference shows the attack works, so its failure is the layer's doing), in a fresh sandbox and in runs
forked from a zygote."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from areal_jax.rewards import _confinement
from areal_jax.rewards.code import run_tests
from areal_jax.rewards.code_tests import TestSpec, asserts_to_spec
from areal_jax.rewards.sandbox import (
    landlock_abi,
    namespace_isolation,
    run_python_sandboxed,
    sandbox_layers,
    seccomp_available,
)
from areal_jax.rewards.zygote import SandboxZygote

ABI = landlock_abi()
needs_landlock = pytest.mark.skipif(ABI == 0, reason="this kernel has no Landlock")

# Switches the audit hooks off from pure Python: the bootstrap hook's re-entrancy flag, reached through the frames of
# a traceback it raised, and os.path.realpath, which every path rule of both hooks goes through.
BYPASS = """
import os
def _switch_off_hooks():
    try:
        open('/nonexistent-dir/f', 'w')
    except PermissionError as e:
        tb = e.__traceback__
        while tb is not None:
            if 'busy' in tb.tb_frame.f_locals:
                tb.tb_frame.f_locals['busy'][0] = True
            tb = tb.tb_next
    except OSError:
        pass
    os.path.realpath = lambda p, *a, **k: os.getcwd()
_switch_off_hooks()
"""


def _fresh(landlock):
    def run(code, **kw):  # processes allowed, as in the zygote: no seccomp filter, only Landlock differs
        return run_python_sandboxed(BYPASS + code, timeout_s=10.0, isolate_network=False, landlock=landlock,
                                    allow_subprocess=True, **kw)
    return run


@pytest.fixture(params=["fresh", "zygote"])
def sandboxes(request):
    """(run with Landlock, run without it) for one launch mode; no namespaces, so that the host's sockets and
    processes are in reach and only Landlock stands between."""
    if request.param == "fresh":
        yield _fresh(True), _fresh(False)
        return
    zygotes = [SandboxZygote(isolate_network=False, landlock=flag) for flag in (True, False)]
    try:
        yield tuple((lambda z: lambda code, **kw: z.run(BYPASS + code, timeout_s=10.0, **kw))(z) for z in zygotes)
    finally:
        for z in zygotes:
            z.close()


@needs_landlock
def test_files_outside_are_neither_read_nor_written(sandboxes, tmp_path):
    confined, reference = sandboxes
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-value")
    target = tmp_path / "pwned"
    code = (f"try:\n    print(open({str(secret)!r}).read())\nexcept OSError as e:\n    print('read denied', e.errno)\n"
            f"try:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError as e:\n    print('write denied', e.errno)\n")
    result = reference(code)
    assert "the-secret-value" in result.stdout and target.exists(), (result.stdout, result.stderr)
    target.unlink()
    result = confined(code)
    assert "the-secret-value" not in result.stdout and not target.exists()
    assert "read denied 13" in result.stdout and "write denied 13" in result.stdout, (result.stdout, result.stderr)


@needs_landlock
def test_no_program_can_be_executed(sandboxes):
    confined, reference = sandboxes
    code = "import os\nos.execv('/bin/sh', ['sh', '-c', 'echo EXECUTED'])\n"
    assert "EXECUTED" in reference(code).stdout
    result = confined(code)
    assert "EXECUTED" not in result.stdout and result.status == "error"
    assert "Permission denied" in result.stderr


@pytest.mark.skipif(ABI < 4, reason="TCP rules need Landlock ABI 4")
def test_tcp_connections_are_refused(sandboxes):
    confined, reference = sandboxes
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(10.0)
    port = server.getsockname()[1]
    received = []

    def accept():
        try:
            while True:
                conn, _ = server.accept()
                received.append(conn.recv(64))
                conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = (f"import socket\ns = socket.socket()\ntry:\n    s.connect(('127.0.0.1', {port}))\n    s.sendall(b'LEAK')\n"
            f"    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)\n")
    try:
        assert reference(code).stdout == "connected\n"
        result = confined(code)
        assert result.stdout.startswith("refused"), (result.stdout, result.stderr)
    finally:
        server.close()
        thread.join(5)
    assert received == [b"LEAK"]  # the reference's message only


@pytest.mark.skipif(ABI < 6, reason="signal scoping needs Landlock ABI 6")
def test_processes_outside_cannot_be_signalled(sandboxes):
    confined, reference = sandboxes
    victims = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        code = "import os, signal\nos.kill({pid}, signal.SIGKILL)\nprint('sent')\n"
        assert reference(code.format(pid=victims[0].pid)).stdout == "sent\n"
        assert victims[0].wait(timeout=10) == -signal.SIGKILL
        result = confined(code.format(pid=victims[1].pid))
        assert "sent" not in result.stdout and "Operation not permitted" in result.stderr, result.stderr
        assert victims[1].poll() is None
    finally:
        for victim in victims:
            victim.kill()
            victim.wait()


@pytest.mark.skipif(ABI < 6, reason="signal scoping needs Landlock ABI 6")
def test_a_forked_run_cannot_signal_or_trace_its_zygote():
    """A run that could signal its zygote could kill it; one that could trace it (no Yama here) could take it over and
    forge later runs' outputs. Without Landlock the signal arrives; with it, both are refused (EPERM)."""
    signal_zygote = "try:\n    os.kill(os.getppid(), 0)\n    print('signal sent')\nexcept OSError as e:\n    print('signal', e.errno)\n"
    trace_zygote = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                    "print('ptrace', libc.ptrace(16, os.getppid(), None, None), ctypes.get_errno())\n")  # PTRACE_ATTACH
    outputs = {}
    for flag, code in ((False, signal_zygote), (True, trace_zygote + signal_zygote)):
        zygote = SandboxZygote(landlock=flag)
        try:
            outputs[flag] = zygote.run(BYPASS + code, timeout_s=10.0)
        finally:
            zygote.close()
    assert outputs[False].stdout == "signal sent\n", outputs[False].stderr
    assert outputs[True].stdout == "ptrace -1 1\nsignal 1\n", (outputs[True].stdout, outputs[True].stderr)


@needs_landlock
def test_ordinary_programs_run_as_they_do_unconfined(tmp_path):
    """Standard-library extension modules (which load system libraries), files and directories in the working
    directory, and numpy where allowed: the same output as a plain interpreter gives."""
    code = ("import bz2, decimal, hashlib, json, lzma, os, sqlite3, zlib\n"
            "os.makedirs('a/b')\nopen('a/b/f.txt', 'w').write('hello')\nos.rename('a/b/f.txt', 'g.txt')\n"
            "db = sqlite3.connect(':memory:')\nrow = db.execute('select 6 * 7').fetchone()\n"
            "print(hashlib.sha256(open('g.txt', 'rb').read()).hexdigest()[:16], zlib.crc32(b'x'), row[0],\n"
            "      len(lzma.compress(b'a' * 100)) > 0, bz2.decompress(bz2.compress(b'z')), decimal.Decimal(1) / 7,\n"
            "      sorted(os.listdir('.')))\n")
    plain = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    expected = plain.stdout.replace("'a', 'g.txt'", "'a', 'g.txt', 'main.py'")
    fresh = run_python_sandboxed(code, timeout_s=20.0)
    assert "landlock" in fresh.isolation and fresh.stdout == expected, fresh.stderr
    zygote = SandboxZygote()
    try:
        forked = zygote.run(code, timeout_s=20.0)
        assert "landlock" in forked.isolation and forked.status == "ok", forked.stderr
        assert forked.stdout.split("[")[0] == plain.stdout.split("[")[0]
    finally:
        zygote.close()
    pytest.importorskip("numpy")
    numeric = run_python_sandboxed("import numpy as np\nprint(int((np.ones((40, 40)) @ np.ones(40)).sum()))",
                                   timeout_s=30.0, allow_numpy=True)
    assert numeric.stdout == "1600\n", numeric.stderr


@needs_landlock
def test_a_test_case_cannot_read_its_answer_from_the_host(tmp_path):
    """Reward hacking through the file system: a stdin task whose expected output sits in a file the reward process
    can read. Both test runners, both launches: never a pass."""
    answer = tmp_path / "answer.txt"
    answer.write_text("42\n")
    program = BYPASS + f"print(open({str(answer)!r}).read(), end='')\n"
    spec = TestSpec(stdio=(("", "42\n"),))
    for runner in ("fork", "process"):
        for launch in ("zygote", "fresh"):
            outcome = run_tests(program, spec, stdio_runner=runner, launch=launch)
            assert outcome.statuses == ("error",), (runner, launch, outcome)


@needs_landlock
def test_a_failed_restriction_runs_nothing(tmp_path):
    """Fail closed: when the kernel refuses the ruleset the bootstrap exits (status 125) before the program runs."""
    (tmp_path / "main.py").write_text("open('ran', 'w').write('yes')\n")
    config = {"workdir": str(tmp_path), "cpu_time_s": 5, "memory_bytes": 1 << 30, "file_bytes": 1 << 20,
              "max_processes": 64, "audit_hook": True, "allow_subprocess": False, "landlock": -1}  # no such ABI
    child = os.path.join(os.path.dirname(_confinement.__file__), "_sandbox_child.py")
    done = subprocess.run([sys.executable, "-I", "-B", "-S", child, json.dumps(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 125 and "confinement could not be applied" in done.stderr
    assert not (tmp_path / "ran").exists()


def test_handled_rights_per_abi():
    """Worked from the kernel's header: 13 file rights in ABI 1, REFER (bit 13) in 2, TRUNCATE (14) in 3, TCP bind and
    connect in 4, IOCTL_DEV (15) in 5, the two scopes in 6."""
    assert _confinement.handled_rights(1) == (0x1FFF, 0, 0)
    assert _confinement.handled_rights(2) == (0x3FFF, 0, 0)
    assert _confinement.handled_rights(3) == (0x7FFF, 0, 0)
    assert _confinement.handled_rights(4) == (0x7FFF, 3, 0)
    assert _confinement.handled_rights(5) == (0xFFFF, 3, 0)
    assert _confinement.handled_rights(7) == (0xFFFF, 3, 3)
    assert ctypes_size(_confinement._PathBeneathAttr) == 12  # packed, as the kernel reads it
    with pytest.raises(OSError, match="no Landlock"):
        _confinement.restrict([], 0)


def ctypes_size(structure) -> int:
    import ctypes

    return ctypes.sizeof(structure)


def test_sandbox_layers_names_what_is_in_force():
    line = sandbox_layers()
    assert ("Landlock ABI %d" % ABI in line) if ABI else ("no Landlock" in line)


def test_requiring_confinement_where_the_kernel_has_none_is_a_config_error(monkeypatch):
    from areal_jax.config import ConfigError
    from areal_jax.rewards import isolation as sandbox
    from areal_jax.rewards.config import RewardConfig

    RewardConfig(fn="code", timeout_s=30.0, code_require_landlock=False).check()  # the default never asks
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
    with pytest.raises(ConfigError, match=r"--config\.reward\.code_require_landlock=True, but this kernel .* no "
                                          r"Landlock.*code_require_landlock=False"):
        RewardConfig(fn="code", timeout_s=30.0, code_require_landlock=True).check()
    RewardConfig(fn="math", code_require_landlock=True).check()  # only the code reward runs programs
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 6)
    RewardConfig(fn="code", timeout_s=30.0, code_require_landlock=True).check()
    assert "no Landlock" not in sandbox.sandbox_layers() and "signals" in sandbox.sandbox_layers()



def _run_bpf(prog, nr: int, arch: int, arg0: int = 0) -> int:
    """A classic-BPF interpreter for the four instruction kinds the filter uses, over a seccomp_data of (nr, arch,
    ip=0, args[0]=arg0), little-endian."""
    data = nr.to_bytes(4, "little", signed=True) + arch.to_bytes(4, "little") + bytes(8) + arg0.to_bytes(8, "little")
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x20:  # ld word at absolute offset k
            acc = int.from_bytes(data[k:k + 4], "little")
        elif code == 0x06:
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_process_filter_decides_as_the_rules_say(machine):
    prog = _confinement.process_filter(machine)
    arch, numbers = _confinement._ARCHES[machine]
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
    for name in ("fork", "vfork", "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev"):
        if name in numbers:
            assert _run_bpf(prog, numbers[name], arch) == eperm, name
    assert _run_bpf(prog, numbers["clone"], arch, arg0=0x3D0F00) == allow  # pthread_create's flags
    assert _run_bpf(prog, numbers["clone"], arch, arg0=0x01200011) == eperm  # fork()'s flags (SIGCHLD | ...)
    assert _run_bpf(prog, numbers["clone3"], arch) == enosys
    for other in (0, 1, 3, 63, 231, 434):  # read, write, close, ..., exit_group: untouched
        if other not in numbers.values():
            assert _run_bpf(prog, other, arch) == allow, other
    assert _run_bpf(prog, 2, 0x40000003) == kill  # another architecture's entry (i386)
    if machine == "x86_64":
        assert _run_bpf(prog, 0x40000000 | 57, arch) == kill  # an x32 entry
    assert _confinement.process_filter("sparc64") is None


@pytest.mark.skipif(not seccomp_available(), reason="no seccomp filter for this architecture")
def test_a_program_without_processes_cannot_fork_but_threads_run():
    code = ("import os, threading\nout = []\nt = threading.Thread(target=lambda: out.append(sum(range(10))))\n"
            "t.start(); t.join()\nprint('thread', out[0])\n"
            "try:\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\n    print('forked')\n"
            "except OSError as e:\n    print('fork', e.errno)\n")
    reference = run_python_sandboxed(code, timeout_s=10.0, audit_hook=False, allow_subprocess=True)
    assert reference.stdout == "thread 45\nforked\n", reference.stderr
    confined = run_python_sandboxed(code, timeout_s=10.0, audit_hook=False)
    assert "seccomp" in confined.isolation
    assert confined.stdout == "thread 45\nfork 1\n", confined.stderr


@pytest.mark.skipif(not seccomp_available(), reason="no seccomp filter for this architecture")
def test_a_test_candidate_cannot_fork_even_past_the_audit_hook():
    """A stdin candidate and a call candidate, with the audit hook switched off: os.fork is refused by the kernel;
    the harness itself, which forks the candidates, works."""
    probe = BYPASS + (
        "import os\n"
        "def fork():\n"
        "    try:\n        pid = os.fork()\n        if pid == 0:\n            os._exit(0)\n        return 'forked'\n"
        "    except OSError as e:\n"
        "        tb = e.__traceback__\n"  # the candidate's own hook keeps its process events in a set: empty it
        "        while tb is not None:\n"
        "            tb.tb_frame.f_locals.get('process_events', set()).clear()\n"
        "            tb = tb.tb_next\n"
        "        return f'fork {e.errno}'\n"
        "first = fork()\nr = fork()\nassert first == 'fork None', first\n")  # the hook's refusal, then the kernel's
    stdin_spec = TestSpec(stdio=(("", "fork 1\n"),))
    call_spec = asserts_to_spec(["assert f() == 'fork 1'"])
    for launch in ("zygote", "fresh"):
        assert run_tests(probe + "print(r)\n", stdin_spec, launch=launch).statuses == ("pass",), launch
        assert run_tests(probe + "def f():\n    return r\n", call_spec, launch=launch).statuses == ("pass",), launch


@needs_landlock
def test_the_installations_own_library_directory_is_readable():
    """A conda or pyenv Python loads its extension modules' libraries (libsqlite3, libssl, libffi) from
    <prefix>/lib, not from the system's: that directory is readable in the sandbox, past the audit hook too."""
    lib = os.path.realpath(os.path.join(sys.base_prefix, "lib"))
    code = f"import os\nprint(sorted(os.listdir({lib!r})) == {sorted(os.listdir(lib))!r})\n"
    assert run_python_sandboxed(code, timeout_s=10.0, audit_hook=False).stdout == "True\n"
    assert run_python_sandboxed(code, timeout_s=10.0).stdout == "True\n"


def test_where_the_filter_is_refused_programs_run_without_it(monkeypatch):
    """A host (a container, say) that refuses seccomp filters must not fail every program: the probe says so and the
    sandbox runs without the filter, saying so in its layers."""
    from areal_jax.rewards import isolation, sandbox

    assert isolation._kernel_probe() == {"landlock": ABI, "seccomp": seccomp_available()}  # one probe, both answers
    monkeypatch.setattr(sandbox, "seccomp_available", lambda: False)  # what the sandbox's command asks
    monkeypatch.setattr(isolation, "seccomp_available", lambda: False)
    code = "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('forked')\n"
    result = run_python_sandboxed(code, timeout_s=10.0, audit_hook=False)
    assert result.stdout == "forked\n" and "seccomp" not in result.isolation, result.stderr
    assert "no seccomp filter" in isolation.sandbox_layers()


FILL_DISK = """
import os
blob = b"x" * (8 << 20)
n = 0
try:
    while n < 40:  # 320 MiB, in files under the per-file limit
        with open(f"f{n}", "wb") as f:
            f.write(blob)
        n += 1
except OSError as e:
    print("refused", e.errno)
print(n * 8, "MiB")
"""


@pytest.mark.skipif("--mount" not in namespace_isolation(), reason="no mount namespace here")
def test_the_working_directory_holds_at_most_disk_mb_and_the_host_disk_nothing():
    """A program that writes file after file (each under the per-file limit) fills the host's temporary directory
    without the tmpfs (the reference) and stops at the tmpfs's size with it, in a fresh sandbox and a forked run."""
    reference = run_python_sandboxed(FILL_DISK, timeout_s=30.0, disk_mb=0)
    assert reference.stdout == "320 MiB\n", reference.stderr
    fresh = run_python_sandboxed(FILL_DISK, timeout_s=30.0, disk_mb=64)
    assert fresh.stdout.startswith("refused 28\n") and int(fresh.stdout.split()[2]) <= 64, fresh.stdout  # ENOSPC
    zygote = SandboxZygote(disk_mb=64)
    try:
        forked = zygote.run(FILL_DISK, timeout_s=30.0)
    finally:
        zygote.close()
    assert forked.stdout.startswith("refused 28\n") and int(forked.stdout.split()[2]) <= 64, forked.stdout
    assert run_python_sandboxed("import os\nprint(os.listdir('.'))").stdout == "['main.py']\n"
