"""Running a program in a forked process inside the sandbox: the part the stdin runner (``_stdio_harness.py``) and the
zygote (``_sandbox_zygote.py``) share. Never imported by the library: its source is put in front of theirs when they
are sent into the sandbox (``sandbox_source``), so both define ``exec_as_main``, ``confine_here``,
``lower_cpu_limit``, ``close_descriptors`` and ``collect_child`` this way."""


def exec_as_main(code, main_file: str) -> None:
    """In a forked process whose descriptors 0 / 1 / 2 are already in place: run ``code`` (source or a code object) as
    ``__main__`` the way a fresh interpreter would and exit with its status (0 when it ends or calls exit(0) /
    sys.exit(), 1 after an uncaught exception, printed to stderr, the code passed to sys.exit otherwise), its
    non-daemon threads joined, its atexit functions run and its output flushed first."""
    import atexit
    import builtins
    import os
    import sys
    import threading
    import traceback
    import types

    atexit._clear()  # what the forking process registered is not the program's to run
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    module = types.ModuleType("__main__")
    module.__file__ = main_file
    module.__builtins__ = builtins
    if "__sandbox_confine__" in globals():  # handed on: a harness run this way confines its candidates with it
        module.__sandbox_confine__ = globals()["__sandbox_confine__"]
    sys.modules["__main__"] = module
    status = 0
    try:
        exec(code if not isinstance(code, str) else compile(code, "main.py", "exec"), module.__dict__)
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code & 0xFF
        else:  # sys.exit("message"): printed to stderr, status 1, as the interpreter does
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - the interpreter's own behaviour: traceback, status 1
        traceback.print_exc()
        status = 1
    main = threading.main_thread()
    for thread in threading.enumerate():  # the interpreter waits for non-daemon threads at exit
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # then runs the program's atexit functions (output buffered until exit, e.g.)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a failed flush at exit is status 120 in CPython
            status = status or 120
    for stream in (sys.__stdout__, sys.__stderr__):  # and flushes the original streams a program replaced, as their
        try:  # finalizers would
            stream.flush()
        except BaseException:  # noqa: BLE001 - as a finalizer's failure, it changes nothing
            pass
    os._exit(status)


def confine_here(workdir: str, processes: bool = True, layer: bool = True) -> None:
    """In a freshly forked process, before it runs anything untrusted (where the sandbox has the means,
    ``__sandbox_confine__``): one more Landlock layer, so that it writes only in ``workdir`` and can neither trace nor
    signal the process that forked it (unless ``layer=False``: a test candidate, which shares its parent's directory
    and whose seccomp filter refuses ptrace), and with ``processes=False`` the seccomp filter: it creates no process.
    Ends the process (status 125) if the kernel refuses: it never runs unconfined."""
    import os

    confine = globals().get("__sandbox_confine__")
    if confine is None:
        return
    try:
        confine(workdir, processes, layer)
    except Exception as e:  # noqa: BLE001 - fail closed
        os.write(2, f"sandbox: the kernel's confinement could not be applied ({e}); the program was not run\n".encode())
        os._exit(125)


def lower_cpu_limit(seconds: int) -> None:
    """This process's CPU limit set to ``seconds`` (hard: one more), or kept where the inherited one is already lower:
    inside the sandbox a limit may only be lowered (a run started with less time left than a case keeps its own; the
    wall clock still stops the case at its limit)."""
    import resource

    inherited = resource.getrlimit(resource.RLIMIT_CPU)[1]
    hard = seconds + 1 if inherited == resource.RLIM_INFINITY else min(seconds + 1, inherited)
    resource.setrlimit(resource.RLIMIT_CPU, (min(seconds, hard), hard))


def close_descriptors(first: int, limit: int) -> None:
    """Close descriptors ``first`` .. ``limit`` - 1 but those ``confine_here`` needs (its read-only paths, opened
    before the audit hook would refuse to open them): a forked process that forks processes of its own to confine
    keeps them."""
    import os

    keep = sorted(fd for fd in getattr(globals().get("__sandbox_confine__"), "fds", ()) if first <= fd < limit)
    for fd in keep:
        os.closerange(first, fd)
        first = fd + 1
    os.closerange(first, limit)


def collect_child(pid: int, out_r: int, timeout_s: float, max_output: int, on_output, control_fd=None,
                  should_stop=None) -> tuple:
    """Read the forked process ``pid``'s stdout pipe ``out_r`` (each piece to ``on_output``, at most ``max_output``
    bytes) until it exits and closes it, ``timeout_s`` passes, the output overflows or ``should_stop()`` (asked when
    ``control_fd`` is readable) says so; kill it if it is still running; close ``out_r``. Returns (status, exit code):
    status "ok" / "error" by its exit code, else "timeout", "output_limit" or "stopped"."""
    import os
    import select
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    status, reading, exited, wait_status, written = None, True, False, 0, 0
    poller = select.poll()
    poller.register(out_r, select.POLLIN | select.POLLHUP)
    if control_fd is not None:
        poller.register(control_fd, select.POLLIN)
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
        if control_fd is not None and control_fd in ready and should_stop():
            status = "stopped"
            break
        if out_r in ready and reading:
            chunk = os.read(out_r, 1 << 16)
            if not chunk:
                reading = False
                poller.unregister(out_r)
            else:
                room = max_output - written
                written += len(chunk)
                if room > 0:
                    on_output(chunk[:room])
                if written > max_output:
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
    exit_code = os.waitstatus_to_exitcode(wait_status)
    if status is None:
        status = "ok" if exit_code == 0 else "error"
    return status, exit_code
