"""Limits the Linux kernel itself enforces on a sandboxed process and every process it starts: Landlock for files,
TCP ports and signals (Linux >= 5.13; the kernel says which version, its ABI, it has), and a seccomp filter that
refuses to create processes or run programs.

The sandbox (``sandbox.py``) applies them in its bootstrap, before the untrusted program's first line: from then on
the process may read only the directories it is given, write only inside its working directory, run no program
(execve is refused), and, where the kernel's ABI has them, neither bind nor connect TCP ports (ABI 4) nor signal a
process outside the sandbox or reach its abstract Unix sockets (ABI 6). A restriction can be added to but never
lifted, by nothing the process does: unlike the audit hook, which pure Python can switch off, it holds against any
code, ctypes and numpy included.

The seccomp filter (``deny_processes``) refuses fork, vfork, a clone that does not make a thread, execve, ptrace and
reading or writing another process's memory (EPERM; clone3 gets ENOSYS, so the C library makes threads with clone):
threads still work, processes do not, whatever the resource limits (which the kernel does not apply to root) allow.
The sandbox filters a program that was not allowed processes, and each test candidate a harness forks.

Only the standard library is used: the parent imports this module to ask for the ABI, and the sandbox's bootstrap,
which cannot import the package, runs its source (``confiner``) and then drops ctypes from ``sys.modules``.
"""

import ctypes
import os
import stat

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# Access rights to files (include/uapi/linux/landlock.h), with the ABI that introduced each.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

READ = READ_FILE | READ_DIR
# What a program may do inside its working directory: everything but running programs and making devices or sockets.
READ_WRITE = (READ | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_FIFO | MAKE_SYM | REFER
              | TRUNCATE)
_FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the rights a rule on a non-directory may hold


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # packed in the kernel's header: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _syscall(libc, number: int, *args) -> int:
    result = libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock syscall {number}: {os.strerror(err)}")
    return result


def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 where it has none (an older kernel, or Landlock not enabled at boot)."""
    try:
        libc = _libc()
        libc.syscall.restype = ctypes.c_long
        return max(0, int(libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), ctypes.c_void_p(None),
                                       ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))))
    except (OSError, AttributeError):
        return 0


def handled_rights(abi: int) -> tuple[int, int, int]:
    """(file rights, network rights, scopes) that a ruleset of this ABI restricts: every one the ABI knows."""
    fs = (1 << 13) - 1
    fs |= REFER if abi >= 2 else 0
    fs |= TRUNCATE if abi >= 3 else 0
    fs |= IOCTL_DEV if abi >= 5 else 0
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    return fs, net, scoped


def restrict(rules: list, abi: int, libc=None) -> None:
    """Restrict this process and its future children for good: each of ``rules``, (path, rights), allows those
    rights beneath the path (a path that does not exist is passed over; an int is a descriptor opened already); every other file right of the ABI, and
    (ABI >= 4) every TCP bind / connect, (ABI >= 6) signals and abstract Unix sockets beyond this process's own domain,
    are refused. Each call adds a layer: a process already restricted can only be restricted further, and a process
    of an inner layer may neither trace nor (ABI >= 6) signal one of an outer layer. ``libc``: a ``_libc()`` whose
    functions were looked up already (looking one up is an audited event the sandbox's audit hook refuses). Raises
    OSError when the kernel refuses the ruleset."""
    if abi < 1:
        raise OSError("this kernel has no Landlock")
    fs, net, scoped = handled_rights(abi)
    if libc is None:
        libc = _libc()
        libc.syscall.restype = ctypes.c_long
    attr = _RulesetAttr(fs, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # what the ABI's struct holds; later fields stay unread
    ruleset = _syscall(libc, _SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        for target, rights in rules:
            if isinstance(target, int):
                fd = target  # opened already (see confiner); stays open
            else:
                try:
                    fd = os.open(target, os.O_PATH | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
            try:
                allowed = rights & fs
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    allowed &= _FILE_ONLY
                if allowed:
                    rule = _PathBeneathAttr(allowed, fd)
                    _syscall(libc, _SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                             ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                if fd is not target:
                    os.close(fd)
        if libc.prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
        _syscall(libc, _SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


# Read-only beyond the Python installation: what the dynamic loader opens when an extension module pulls in a system
# library, the CPU topology numerical libraries size their thread pools by, and the harmless character devices.
SYSTEM_READ = ("/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/local/lib",
               "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/sys/devices/system/cpu",
               "/dev/urandom", "/dev/random", "/dev/zero")


def shared_rules(read_dirs) -> list:
    """The rules every layer of the sandbox shares: reading ``read_dirs`` (the installation) and SYSTEM_READ;
    reading and writing /dev/null."""
    return [("/dev/null", READ_FILE | WRITE_FILE | TRUNCATE), *((path, READ) for path in (*read_dirs, *SYSTEM_READ))]


def sandbox_rules(workdir: str, read_dirs) -> list:
    """The sandbox's rules: everything but running programs inside ``workdir``, and ``shared_rules``."""
    return [(workdir, READ_WRITE), *shared_rules(read_dirs)]


# ---- the working directory's size ----
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8


def mount_tmpfs(path: str, size_bytes: int, libc=None) -> None:
    """Mount a tmpfs of at most ``size_bytes`` over ``path`` (nosuid, nodev, noexec): what the program writes there
    lives in memory, within that bound, and vanishes with the sandbox's mount namespace (``unshare --mount``, in
    which this process holds CAP_SYS_ADMIN). OSError where the kernel refuses."""
    libc = libc or _libc()
    options = f"size={int(size_bytes)},mode=0700".encode()
    flags = ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    if libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


# ---- seccomp ----
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1, 1 << 2
_SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF opcodes (classic BPF)
# (audit arch, {name: number}) of the architectures this knows; elsewhere no filter is installed.
_ARCHES = {
    "x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "execve": 59, "execveat": 322,
                            "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311}),
    "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435, "execve": 221, "execveat": 281, "ptrace": 117,
                             "process_vm_readv": 270, "process_vm_writev": 271}),
}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def process_filter(machine: str) -> list | None:
    """The classic-BPF program (code, jt, jf, k) that refuses new processes on ``machine`` (``os.uname().machine``),
    None for an architecture this does not know. A system call of another architecture (x86-64's 32-bit and x32
    entries) kills the process: the numbers below would not hold for it."""
    if machine not in _ARCHES:
        return None
    arch, numbers = _ARCHES[machine]
    deny = ("fork", "vfork", "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev")
    prog = [(_LD_ABS_W, 0, 0, 4), ("jeq", arch, None, "kill"), (_LD_ABS_W, 0, 0, 0)]
    if machine == "x86_64":
        prog.append(("jge", 0x40000000, "kill", None))  # the x32 entries
    prog += [("jeq", numbers[name], "eperm", None) for name in deny if name in numbers]
    prog += [("jeq", numbers["clone3"], "enosys", None), ("jeq", numbers["clone"], None, "allow"),
             (_LD_ABS_W, 0, 0, 16), ("jset", _CLONE_THREAD, "allow", "eperm"),  # the low half of clone's flags
             ("label", "allow"), (_RET, 0, 0, _RET_ALLOW), ("label", "eperm"), (_RET, 0, 0, _RET_ERRNO | _EPERM),
             ("label", "enosys"), (_RET, 0, 0, _RET_ERRNO | _ENOSYS),
             ("label", "kill"), (_RET, 0, 0, _RET_KILL_PROCESS)]
    labels, position = {}, 0
    for item in prog:
        if item[0] == "label":
            labels[item[1]] = position
        else:
            position += 1
    out = []
    for item in prog:
        if item[0] == "label":
            continue
        if isinstance(item[0], str):
            op, k, yes, no = item
            here = len(out) + 1  # jumps count from the next instruction
            out.append(({"jeq": _JEQ, "jge": _JGE, "jset": _JSET}[op], 0 if yes is None else labels[yes] - here,
                        0 if no is None else labels[no] - here, k))
        else:
            out.append(item)
    return out


def _filter_program(machine: str):
    """``process_filter`` as the kernel reads it (a sock_fprog and the array it points at), None where unknown."""
    prog = process_filter(machine)
    if prog is None:
        return None
    filters = (_SockFilter * len(prog))(*(_SockFilter(*insn) for insn in prog))
    return _SockFprog(len(prog), filters), filters


def deny_processes(libc=None, program=None) -> bool:
    """Install ``process_filter`` on this thread's process for good (with no_new_privs, which it needs). False where
    the architecture is unknown (nothing installed); OSError where the kernel refuses. ``program``: a
    ``_filter_program`` built already (building it is most of the cost)."""
    program = program or _filter_program(os.uname().machine)
    if program is None:
        return False
    libc = libc or _libc()
    fprog = program[0]
    if libc.prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    # SPEC_ALLOW: without it the kernel also turns on its speculative-store-bypass mitigation for the process, which
    # slowed sandboxed test runs by about a tenth here; it guards a process's memory against code in the same
    # process, and a test candidate holds nothing the program could not read directly anyway.
    number = _SYS_SECCOMP.get(os.uname().machine)
    if number is not None:
        libc.syscall.restype = ctypes.c_long
        done = libc.syscall(ctypes.c_long(number), ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
                            ctypes.c_uint(_SECCOMP_FILTER_FLAG_SPEC_ALLOW), ctypes.byref(fprog))
        if done == 0:
            return True
    # An older kernel (before 4.17) without the flag: the filter alone.
    if libc.prctl(ctypes.c_int(_PR_SET_SECCOMP), ctypes.c_ulong(_SECCOMP_MODE_FILTER),
                  ctypes.cast(ctypes.byref(fprog), ctypes.c_void_p), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")
    return True


def confiner(abi: int, read_dirs):
    """A function ``confine(workdir, processes=True, layer=True)`` that restricts the calling process for good: one
    more Landlock layer of ``sandbox_rules(workdir, read_dirs)`` (when ``abi`` > 0 and ``layer``) and, with
    ``processes=False``, the seccomp filter that refuses new processes (and ptrace: a process under it cannot reach
    another's memory, which is what a test candidate needs kept from it; its directory is its parent's own layer's). Its library functions are looked up and the read-only paths opened (O_PATH)
    now, while that is allowed: later the sandbox's audit hook refuses both, and a process can still be confined
    after it has closed its other descriptors (keep these: ``confine.fds``)."""
    if abi < 0:
        raise ValueError(f"a Landlock ABI is a version >= 1, or 0 for none; got {abi}")
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    libc.prctl  # noqa: B018 - looked up now, while that is allowed
    opened = []
    for path, rights in shared_rules(read_dirs) if abi > 0 else ():
        try:
            opened.append((os.open(path, os.O_PATH | os.O_CLOEXEC), rights))
        except FileNotFoundError:
            pass

    program = _filter_program(os.uname().machine)

    def confine(workdir: str, processes: bool = True, layer: bool = True) -> None:
        if abi > 0 and layer:
            restrict([(os.path.realpath(workdir), READ_WRITE), *opened], abi, libc)
        if not processes:
            deny_processes(libc, program)

    confine.fds = tuple(fd for fd, _ in opened)
    return confine
