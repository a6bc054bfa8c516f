"""Sandbox working directories: removed when their sandbox ends, and swept by the next process when their owner was
killed before it could remove them (a reward worker killed at a sample's time limit)."""

import fcntl
import os
import signal
import subprocess
import sys
import time

from areal_jax.rewards import workdirs
from areal_jax.rewards.sandbox import run_python_sandboxed
from areal_jax.rewards.zygote import SandboxZygote

# Starts a zygote and a fresh sandbox whose program sleeps, then kills its own process outright: neither can clean up.
KILLED_OWNER = """
import os, signal, sys, threading, time
from areal_jax.rewards.sandbox import run_python_sandboxed
from areal_jax.rewards.zygote import SandboxZygote
zygote = SandboxZygote()
threading.Thread(target=run_python_sandboxed, args=("import time; time.sleep(60)",), kwargs={"timeout_s": 60},
                 daemon=True).start()
time.sleep(1.5)
print(zygote._workdir, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _ours(root):
    return sorted(d for d in os.listdir(root) if d.startswith(workdirs.PREFIX) and not d.endswith(".lock"))


def test_a_finished_sandbox_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(workdirs.tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    assert run_python_sandboxed("print(1)").stdout == "1\n"
    zygote = SandboxZygote()
    assert zygote.run("print(2)").stdout == "2\n"
    zygote.close()
    assert os.listdir(tmp_path) == []


def test_the_directories_of_a_killed_owner_are_swept_by_the_next_process(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", KILLED_OWNER], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    left = _ours(tmp_path)  # the zygote's directory and the fresh sandbox's
    assert len(left) == 2 and os.path.basename(done.stdout.strip()) in left
    # A live owner's directory (its lock held here) stays whatever its age; every directory stays while young.
    held = os.path.join(str(tmp_path), workdirs.PREFIX + "live")
    os.mkdir(held)
    fd = os.open(held + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    assert workdirs.sweep_abandoned_workdirs(str(tmp_path)) == 0  # every lock younger than a minute
    old = time.time() - 3600
    for name in os.listdir(tmp_path):
        os.utime(os.path.join(str(tmp_path), name), (old, old))
    assert workdirs.sweep_abandoned_workdirs(str(tmp_path)) == 2
    assert _ours(tmp_path) == [workdirs.PREFIX + "live"]
    os.close(fd)
