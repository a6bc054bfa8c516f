"""A long-lived sandboxed process that forks a fresh process per sandboxed run (see ``zygote.py``); never imported
by the library.

Its source becomes the sandbox's ``main.py``, started by ``run_python_sandboxed``'s bootstrap with process creation
allowed (namespaces, resource limits and the audit hook already in place). It never runs untrusted code itself: for
each request it forks a run process, which starts from this pristine state, moves into a fresh directory of its own,
takes the request's text as its standard input, a pipe to this process as its standard output and a file as its
standard error, closes every other descriptor and runs the request's source as ``__main__`` (exit status as a fresh
interpreter would give it). A fork costs about a millisecond where a new sandboxed interpreter costs about thirty.

Requests, one JSON line each on stdin: {"op": "run", "id", "source", "stdin", "timeout_s", "max_output_bytes",
"processes" (may the run create processes; false: the seccomp filter refuses them, where the sandbox has it)} and
{"op": "stop", "id"} (kill that run: its outcome is settled). Replies on stdout: {"id", "out": <stdout piece as
latin-1 text>} as the run writes, then {"id", "end": true, "status": "ok" | "error" | "timeout" | "output_limit" |
"stopped", "exit_code", "stderr": <its first 4 KiB>}. Runs go one at a time. It is sent into the sandbox after
``_fork_run.py``'s source, which defines ``exec_as_main`` and ``collect_child`` (a run's own source comes the same way).
"""
# ruff: noqa: F821 - exec_as_main, confine_here, lower_cpu_limit, close_descriptors and collect_child come from _fork_run.py, sent in front of this source


def _zygote() -> None:
    # Imported once here for every run: what exec_as_main and the test harnesses import (about 4 ms a run).
    import ast  # noqa: F401
    import importlib  # noqa: F401
    import io  # noqa: F401
    import json
    import os
    import resource
    import secrets
    import select
    import shutil
    import signal
    import sys
    import threading  # noqa: F401
    import traceback  # noqa: F401
    import types  # noqa: F401

    root = os.getcwd()
    fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fd_limit = fd_limit if 0 < fd_limit < (1 << 20) else (1 << 20)
    requests = os.fdopen(0, "rb", buffering=0)
    pending = bytearray()
    running = {"pid": None}  # the run process in progress, killed if the parent goes away

    def send(record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        while data:
            data = data[os.write(1, data):]

    def next_line(block: bool) -> dict | None:
        """The next request, reading stdin (blocking when asked); None when none is complete yet."""
        while b"\n" not in pending:
            if not block and not select.select([0], [], [], 0)[0]:
                return None
            chunk = requests.read(1 << 16)
            if not chunk:  # the parent is gone: so is everything here
                if running["pid"] is not None:
                    try:
                        os.kill(running["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os._exit(0)
            pending.extend(chunk)
        line, _, rest = bytes(pending).partition(b"\n")
        pending[:] = rest
        return json.loads(line)

    def confine_writes(workdir: str) -> None:
        """Writes only inside this run's own directory (the bootstrap's hook allows the zygote's whole directory,
        where other runs' directories come and go)."""
        own = os.path.realpath(workdir)
        write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        path_events = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown", "os.link",
                       "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}

        def inside(path) -> bool:
            if path is None or isinstance(path, int):
                return True
            p = os.path.realpath(os.fsdecode(path))
            return p == own or p.startswith(own + "/")

        def hook(event, args):
            if event == "open" and len(args) >= 3:
                path, mode, flags = args[:3]
                write = bool(mode and any(c in str(mode) for c in "wax+")) or bool(
                    isinstance(flags, int) and flags & write_flags)
                if write and not inside(path):
                    raise PermissionError(f"sandbox: writing {path} is not allowed")
            elif event in path_events:
                for path in args[:2]:
                    if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                        raise PermissionError(f"sandbox: {event} {path} is not allowed")

        sys.addaudithook(hook)

    def run_child(request: dict, workdir: str, out_w: int) -> None:
        """The run process: from here on it runs the request's source, untrusted."""
        os.setpgid(0, 0)  # its own process group, killed whole at the end when there is no PID namespace
        lower_cpu_limit(int(float(request["timeout_s"])) + 2)  # CPU seconds of this run (and each process it forks)
        os.chdir(workdir)
        # Landlock: writes in its own directory only, the zygote out of its reach; no processes unless asked for
        confine_here(workdir, processes=bool(request.get("processes", True)))
        confine_writes(workdir)
        with open("stdin", "w", encoding="utf-8") as f:
            f.write(request["stdin"])
        os.dup2(os.open("stdin", os.O_RDONLY), 0)
        os.dup2(out_w, 1)
        os.dup2(os.open("stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        close_descriptors(3, fd_limit)  # all but what confines the processes a harness forks
        sys.argv = ["main.py"]
        exec_as_main(request["source"], os.path.join(workdir, "main.py"))

    def end_everything_but_me(pid: int) -> None:
        """Kill what a run left behind (a harness's candidate process outlives a harness killed at its time limit)
        and reap it: as PID 1 of the sandbox's PID namespace, every other process in it; else the run's group."""
        try:
            if os.getpid() == 1:
                os.kill(-1, signal.SIGKILL)  # from a namespace's init: every process of the namespace but this one
            else:
                os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        while True:  # SIGKILL is prompt; what was killed here is a child of this process (or gone)
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break

    def serve(request: dict) -> None:
        rid = request["id"]
        workdir = os.path.join(root, "run-" + secrets.token_hex(8))
        os.mkdir(workdir, 0o700)
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(out_r)
                run_child(request, workdir, out_w)
            finally:
                os._exit(1)
        os.close(out_w)
        running["pid"] = pid

        def should_stop() -> bool:
            control = next_line(block=False)
            return control is not None and control.get("op") == "stop" and control.get("id") == rid

        status, exit_code = collect_child(
            pid, out_r, float(request["timeout_s"]), int(request["max_output_bytes"]),
            lambda chunk: send({"id": rid, "out": chunk.decode("latin-1")}), control_fd=0, should_stop=should_stop)
        end_everything_but_me(pid)
        running["pid"] = None
        try:
            with open(os.path.join(workdir, "stderr"), "rb") as f:
                stderr = f.read(4096).decode("utf-8", "replace")
        except OSError:
            stderr = ""
        shutil.rmtree(workdir, ignore_errors=True)
        send({"id": rid, "end": True, "status": status, "exit_code": exit_code, "stderr": stderr})

    while True:
        request = next_line(block=True)
        if request.get("op") == "run":
            serve(request)


_zygote()
