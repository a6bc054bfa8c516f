"""Bootstrap that runs inside the sandbox process (see ``sandbox.py``); never imported by the library.

Started as ``python -I -B -S _sandbox_child.py '<json config>'`` with the working directory already set to
the sandbox's fresh temporary directory. It restricts itself with Landlock where the kernel has it (reads of the
installation and its directory, writes in its directory only, no execve, no TCP, no signals out) and a seccomp
filter (no new processes, unless the program is allowed them), applies the resource
limits to itself, installs an audit
hook that denies network, process creation and file access outside the allowed roots, then executes
``main.py`` from the working directory as ``__main__``. Only the standard library is used here so the
bootstrap costs a bare interpreter start.

Config keys: workdir (str), cpu_time_s (int), memory_bytes (int), file_bytes (int), max_processes
(int), audit_hook (bool), allow_subprocess (bool), blocked_import_error (bool: a blocked import raises ImportError
rather than PermissionError, so libraries that only try ctypes, numpy among them, import without it), paths
(optional: the installation's stdlib / platstdlib / purelib / platlib directories as the parent's sysconfig
reports them for this interpreter; importing sysconfig here instead costs a third of a bare start), landlock (int:
the kernel's Landlock ABI to restrict this process with, ``_confinement.py``; 0: none), seccomp (bool: filter out
new processes unless allow_subprocess, and give the program the means to filter the processes it forks), disk_bytes
(int: mount a tmpfs of this size over the working directory, in the sandbox's own mount namespace; 0: none).
"""

import builtins
import json
import os
import resource
import signal
import sys
import types

_PROCESS_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "os.startfile",
})
_PATH_EVENTS_WRITE = frozenset({
    "os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown", "os.link",
    "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile",
    "os.chdir", "os.chroot", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr",
})
_PATH_EVENTS_READ = frozenset({"os.listdir", "os.scandir", "glob.glob", "os.getxattr", "os.listxattr"})
_ALWAYS_BLOCKED = frozenset({"resource.setrlimit", "resource.prlimit", "ctypes.dlopen",
                             "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function"})
_BLOCKED_IMPORTS = frozenset({"ctypes", "_ctypes", "cffi", "_cffi_backend"})
_READABLE_FILES = frozenset({"/dev/null", "/dev/urandom", "/dev/random", "/dev/zero"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class _BlockedImport(ImportError):
    """What the audit hook raises for a blocked import when the config's blocked_import_error is on."""


def _only_lowers(args: tuple) -> bool:
    """Whether resource.setrlimit(*args) keeps both limits at or below the current hard limit (a root process could
    otherwise raise it)."""
    try:
        which, (soft, hard) = args[0], args[1]
        current = resource.getrlimit(which)[1]
    except (TypeError, ValueError, IndexError, OSError):
        return False
    inf = resource.RLIM_INFINITY

    def at_most(value: int, limit: int) -> bool:
        return limit == inf or (value != inf and 0 <= value <= limit)

    return isinstance(soft, int) and isinstance(hard, int) and at_most(hard, current) and at_most(soft, hard)


def _set_limit(which: int, soft: int, hard: int) -> None:
    try:
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
        pass  # not supported here (e.g. RLIMIT_NPROC ignored for root): the other layers still hold


def _apply_limits(cfg: dict) -> None:
    cpu = int(cfg["cpu_time_s"])
    _set_limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _set_limit(resource.RLIMIT_AS, int(cfg["memory_bytes"]), int(cfg["memory_bytes"]))
    _set_limit(resource.RLIMIT_FSIZE, int(cfg["file_bytes"]), int(cfg["file_bytes"]))
    _set_limit(resource.RLIMIT_NPROC, int(cfg["max_processes"]), int(cfg["max_processes"]))
    _set_limit(resource.RLIMIT_CORE, 0, 0)

    def on_cpu_limit(signum, frame):  # PID 1 of a PID namespace ignores default-action SIGXCPU
        os.write(2, b"\nsandbox: CPU time limit exceeded\n")
        os._exit(128 + signal.SIGXCPU)

    signal.signal(signal.SIGXCPU, on_cpu_limit)


def _install_paths(cfg: dict) -> dict:
    """The installation's directories: from the config when the parent sent them, else from sysconfig."""
    if isinstance(cfg.get("paths"), dict):
        return cfg["paths"]
    import sysconfig

    return sysconfig.get_paths()


def _read_roots(workdir: str, install_paths: dict | None) -> tuple:
    """The directories the program may read: its working directory, the installation's and sys.path's, and the
    installation's own library directories (``<prefix>/lib``: a conda or pyenv Python's extension modules load
    libsqlite3, libssl, libffi, ... from there, not from the system's)."""
    candidates = [workdir, *((install_paths or {}).get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib"))]
    candidates += [entry for entry in sys.path if entry and os.path.isabs(entry)]
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        candidates += [os.path.join(prefix, "lib"), os.path.join(prefix, "lib64")]
    return tuple(sorted({os.path.realpath(p) for p in candidates if p and os.path.isdir(p)}))


def _confine_self(cfg: dict, workdir: str, install_paths: dict | None, source: str):
    """Restrict this process with the kernel's rules (``_confinement.py``, run from its source: this bootstrap cannot
    import the package): first a size-limited tmpfs over the working directory when ``disk_bytes`` is set (the
    sandbox has its own mount namespace; ``main.py`` is written back into it), then a Landlock layer when the config
    names an ABI, and the seccomp filter against new processes when ``seccomp`` is on and the program is not allowed
    processes. Returns ``confine(dir, processes=True)``, which adds one more layer for a process the program forks
    (the zygote's runs, a harness's candidates): that process may then write only in ``dir``, can neither trace nor
    signal the process it came from and, with processes=False, creates none. ctypes, which this needs, leaves
    ``sys.modules`` afterwards so that the program's own import of it still meets the audit hook. A failure ends the
    sandbox (status "error"): the program is never run unconfined."""
    namespace = {"__name__": "_confinement"}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_confinement.py")
    own = os.path.realpath(workdir)
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), namespace)
        if cfg.get("disk_bytes"):
            namespace["mount_tmpfs"](own, int(cfg["disk_bytes"]))
            os.chdir(own)  # into the tmpfs: the directory underneath is out of reach from here on
            with open("main.py", "w", encoding="utf-8") as f:
                f.write(source)
        abi, seccomp = int(cfg.get("landlock", 0)), bool(cfg.get("seccomp"))
        if not (abi or seccomp):
            return None
        confine = namespace["confiner"](abi, [d for d in _read_roots(workdir, install_paths) if d != own])
        confine(own, processes=bool(cfg["allow_subprocess"]) or not seccomp)
        return confine
    except Exception as e:  # noqa: BLE001 - fail closed, whatever went wrong
        os.write(2, f"sandbox: the kernel's confinement could not be applied ({e}); the program was not run\n".encode())
        os._exit(125)
    finally:
        for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
            del sys.modules[name]


def _install_audit_hook(workdir: str, allow_subprocess: bool, blocked_import_error: bool = False,
                        install_paths: dict | None = None) -> None:
    write_root = os.path.realpath(workdir)
    read_roots_t = _read_roots(workdir, install_paths)
    busy = [False]

    def under(path: str, roots) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    def allowed(path, write: bool) -> bool:
        if path is None or isinstance(path, int):
            return True  # operations on an already-open descriptor
        p = os.path.realpath(os.fsdecode(path))
        if under(p, (write_root,)):
            return True
        if write:
            return False
        return p in _READABLE_FILES or under(p, read_roots_t)

    def deny(event: str, detail: object = "") -> None:
        raise PermissionError(f"sandbox: {event} {detail!s} is not allowed".replace("  ", " "))

    def hook(event: str, args: tuple) -> None:
        if busy[0]:
            return
        busy[0] = True
        try:
            if event == "open":
                path, mode, flags = (tuple(args) + (None, None, None))[:3]
                write = bool(mode and any(c in str(mode) for c in "wax+")) or bool(
                    isinstance(flags, int) and flags & _WRITE_FLAGS)
                if not allowed(path, write):
                    deny("opening", path)
            elif event.startswith("socket."):
                deny("network access", f"({event})")
            elif event == "resource.setrlimit" and _only_lowers(args):
                pass  # tightening a limit of this process (the zygote's run processes do) gives nothing away
            elif event in _ALWAYS_BLOCKED:
                deny(event)
            elif event == "import" and args and args[0] in _BLOCKED_IMPORTS:
                if blocked_import_error:  # numpy's `try: import ctypes / except ImportError` then goes on without
                    raise _BlockedImport(f"sandbox: importing {args[0]} is not allowed")
                deny("importing", args[0])
            elif not allow_subprocess and (
                event in _PROCESS_EVENTS
                or (event == "import" and args and args[0] == "_posixsubprocess")
            ):
                what = args[0] if event == "import" else event
                deny("starting or signalling processes", f"({what})")
            elif event in _PATH_EVENTS_WRITE:
                for path in args[:2] if event in ("os.rename", "os.link", "shutil.move",
                                                  "shutil.copyfile") else args[:1]:
                    if isinstance(path, (str, bytes, os.PathLike)) and not allowed(path, True):
                        deny(event, path)
            elif event in _PATH_EVENTS_READ:
                path = args[0] if args else None
                if isinstance(path, (str, bytes, os.PathLike)) and not allowed(path, False):
                    deny(event, path)
        finally:
            busy[0] = False

    sys.addaudithook(hook)


def _add_site_packages(paths: dict) -> None:
    """Put the installation's site-packages on sys.path without running their ``.pth`` files: the interpreter
    starts with ``-S`` (no ``site``), which spares every sandboxed run the import hooks that ``.pth`` files start
    (an editable install's finder and the like took 30 ms of a 40 ms start) and keeps them out of the sandbox.
    Packages installed the ordinary way still import; ones reachable only through a ``.pth`` hook do not."""
    for key in ("purelib", "platlib"):
        path = paths.get(key)
        if path and os.path.isdir(path) and path not in sys.path:
            sys.path.append(path)


class _Exit:
    """``exit`` / ``quit`` as a program meets them in a plain interpreter, where ``site`` puts them among the builtins:
    calling one raises SystemExit with the code given. Without ``site`` (-S) a program ending with ``print(-1);
    exit()``, common in contest solutions, would stop at a NameError instead."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Use {self.name}() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code: object = None) -> None:
        raise SystemExit(code)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    install_paths = _install_paths(cfg)
    if sys.flags.no_site:
        _add_site_packages(install_paths)
        for name in ("exit", "quit"):
            if not hasattr(builtins, name):
                setattr(builtins, name, _Exit(name))
    workdir = cfg["workdir"]
    os.chdir(workdir)
    with open(os.path.join(workdir, "main.py"), encoding="utf-8") as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    sys.path.insert(0, workdir)
    confine = None
    if cfg.get("landlock") or cfg.get("seccomp") or cfg.get("disk_bytes"):
        confine = _confine_self(cfg, workdir, install_paths, source)
    _apply_limits(cfg)
    sys.argv = ["main.py"]
    if cfg["audit_hook"]:
        _install_audit_hook(workdir, bool(cfg["allow_subprocess"]), bool(cfg.get("blocked_import_error")),
                            install_paths)
    module = types.ModuleType("__main__")
    module.__file__ = os.path.join(workdir, "main.py")
    module.__builtins__ = __builtins__
    if confine is not None:  # only ever restricts further: harmless in the program's hands
        module.__sandbox_confine__ = confine
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


if __name__ == "__main__":
    main()
