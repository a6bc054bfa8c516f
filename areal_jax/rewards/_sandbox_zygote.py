"""A long-lived sandboxed process that forks a fresh process per sandboxed run (see ``zygote.py``); never imported
by the library.

Its source becomes the sandbox's ``main.py``, started by ``run_python_sandboxed``'s bootstrap with process creation
allowed (namespaces, resource limits and the audit hook already in place). It never runs untrusted code itself: for
each request it forks a run process, which starts from this pristine state, moves into a fresh directory of its own,
takes the request's text as its standard input, a pipe to this process as its standard output and a file as its
standard error, closes every other descriptor and runs the request's source as ``__main__`` (exit status as a fresh
interpreter would give it). A fork costs about a millisecond where a new sandboxed interpreter costs about thirty.

Requests, one JSON line each on stdin: {"op": "run", "id", "source", "stdin", "timeout_s", "max_output_bytes"} and
{"op": "stop", "id"} (kill that run: its outcome is settled). Replies on stdout: {"id", "out": <stdout piece as
latin-1 text>} as the run writes, then {"id", "end": true, "status": "ok" | "error" | "timeout" | "output_limit" |
"stopped", "exit_code", "stderr": <its first 4 KiB>}. Runs go one at a time.
"""


def _zygote() -> None:
    import ast  # noqa: F401 - imported once here for every run: the test harnesses use these (about 4 ms a run)
    import builtins
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
    import threading
    import time
    import traceback
    import types

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
        cpu = int(float(request["timeout_s"])) + 2  # CPU seconds of this run (and each process it forks)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # lowering is all the audit hook allows
        os.chdir(workdir)
        confine_writes(workdir)
        with open("stdin", "w", encoding="utf-8") as f:
            f.write(request["stdin"])
        os.dup2(os.open("stdin", os.O_RDONLY), 0)
        os.dup2(out_w, 1)
        os.dup2(os.open("stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        os.closerange(3, fd_limit)
        sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.argv = ["main.py"]
        module = types.ModuleType("__main__")
        module.__file__ = os.path.join(workdir, "main.py")
        module.__builtins__ = builtins
        sys.modules["__main__"] = module
        code = 0
        try:
            exec(compile(request["source"], "main.py", "exec"), module.__dict__)
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code & 0xFF
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - the interpreter's own behaviour: traceback, status 1
            traceback.print_exc()
            code = 1
        main = threading.main_thread()
        for thread in threading.enumerate():
            if thread is not main and not thread.daemon:
                thread.join()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                code = code or 120
        os._exit(code)

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
        deadline = time.monotonic() + float(request["timeout_s"])
        cap, written = int(request["max_output_bytes"]), 0
        status, reading, exited, wait_status = None, True, False, 0
        poller = select.poll()
        poller.register(out_r, select.POLLIN | select.POLLHUP)
        poller.register(0, select.POLLIN)
        try:
            exit_fd = os.pidfd_open(pid)
            poller.register(exit_fd, select.POLLIN)
        except (AttributeError, OSError):
            exit_fd = None
        while status is None and (reading or not exited):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            ready = {fd for fd, _ in poller.poll(min(remaining, 0.05 if exit_fd is None else remaining) * 1000)}
            if 0 in ready:
                control = next_line(block=False)
                if control is not None and control.get("op") == "stop" and control.get("id") == rid:
                    status = "stopped"
                    break
            if out_r in ready and reading:
                chunk = os.read(out_r, 1 << 16)
                if not chunk:
                    reading = False
                    poller.unregister(out_r)
                else:
                    room = cap - written
                    written += len(chunk)
                    if room > 0:
                        send({"id": rid, "out": chunk[:room].decode("latin-1")})
                    if written > cap:
                        status = "output_limit"
            if not exited and (exit_fd is None or exit_fd in ready or not reading):
                done, wait_status = os.waitpid(pid, os.WNOHANG)
                exited = done == pid
                if exited and exit_fd is not None:
                    poller.unregister(exit_fd)  # readable from now on: it would wake every poll
        os.close(out_r)
        if exit_fd is not None:
            os.close(exit_fd)
        if not exited:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, wait_status = os.waitpid(pid, 0)
        end_everything_but_me(pid)
        running["pid"] = None
        exit_code = os.waitstatus_to_exitcode(wait_status)
        if status is None:
            status = "ok" if exit_code == 0 else "error"
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
