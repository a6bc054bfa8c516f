"""Standard-input test runner that runs inside the sandbox (see ``code.py``); never imported by the library.

Its source becomes the sandbox's ``main.py`` (started with process creation allowed, for the forks below). It reads
one JSON payload from stdin before any untrusted code runs: {"nonce", "program", "inputs": [str], "case_timeout_s",
"max_output_bytes" (per case: a list, or one number), "stop_on_error"}. The expected outputs never enter the sandbox.

The program never runs in this process. For each case a forked child (the candidate process) takes the case's
input as its standard input (a file in the sandbox's directory), a pipe to this process as its standard output and
a file as its standard error, closes every other descriptor, denies itself process creation and signals, and runs
the program as ``__main__`` the way a fresh interpreter would: exit status 0 when it ends or calls exit(0) /
sys.exit(), 1 after an uncaught exception (printed to its stderr), the code it passes to sys.exit or os._exit
otherwise, its non-daemon threads joined and its stdout flushed first. This process reads the pipe (at most
max_output_bytes), waits for the child, kills it past case_timeout_s and reports one stdout line "<nonce> <json>":
{"i", "status": "ok" | "error" | "timeout" | "output_limit", "stdout"}. The child holds no descriptor of this
process's stdout, so it cannot write reports; the sandbox's parent compares each stdout with the expected output.
A fork costs about a millisecond where a fresh sandboxed interpreter costs about thirty. It is sent into the sandbox
after ``_fork_run.py``'s source, which defines ``exec_as_main`` and ``collect_child``.
"""
# ruff: noqa: F821 - exec_as_main, confine_here, lower_cpu_limit and collect_child come from _fork_run.py, sent in front of this source


def _harness() -> None:
    import json
    import math
    import os
    import resource
    import sys

    payload = json.loads(sys.stdin.read())
    nonce, timeout = payload["nonce"], float(payload["case_timeout_s"])
    caps = payload["max_output_bytes"]  # per case: a list, or one number for every case
    caps = [int(c) for c in caps] if isinstance(caps, list) else [int(caps)] * len(payload["inputs"])
    try:
        source = compile(payload["program"], "main.py", "exec")  # compiling runs nothing
    except (SyntaxError, ValueError):  # the interpreter would stop with status 1 on every case
        source = None
    workdir = os.getcwd()
    input_path, stderr_path = os.path.join(workdir, "case_stdin"), os.path.join(workdir, "case_stderr")
    process_events = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                      "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill"}
    fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fd_limit = fd_limit if 0 < fd_limit < (1 << 20) else (1 << 20)

    def report(record: dict) -> None:
        os.write(1, (nonce + " " + json.dumps(record) + "\n").encode())

    # ---- the candidate process: untrusted from the moment the program runs ----
    def candidate(stdout_w: int) -> None:
        os.dup2(os.open(input_path, os.O_RDONLY), 0)
        os.dup2(stdout_w, 1)
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        # The kernel's rules: no processes, no ptrace (so the runner's memory, with the nonce, stays out of reach);
        # the directory is already the run's own Landlock layer's
        confine_here(workdir, processes=False, layer=False)
        os.closerange(3, fd_limit)
        lower_cpu_limit(int(math.ceil(timeout)) + 1)  # the case's CPU seconds, as an interpreter per case gets them

        def deny(event, args):
            if event in process_events or (event == "import" and args and args[0] == "_posixsubprocess"):
                raise PermissionError(f"sandbox: {event} is not allowed in the candidate process")

        sys.addaudithook(deny)
        exec_as_main(source, os.path.join(workdir, "main.py"))

    # ---- this process: trusted; forks a candidate per case and reads its output ----
    def run_case(text: str, max_output: int) -> dict:
        with open(input_path, "w", encoding="utf-8") as f:
            f.write(text)
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(out_r)
                candidate(out_w)
            finally:
                os._exit(1)
        os.close(out_w)
        output = bytearray()
        status, _ = collect_child(pid, out_r, timeout, max_output, output.extend)
        return {"status": status, "stdout": bytes(output).decode("utf-8", "replace")}

    for i, text in enumerate(payload["inputs"]):
        record = {"i": i, **(run_case(text, caps[i]) if source is not None else {"status": "error", "stdout": ""})}
        report(record)
        if record["status"] != "ok" and payload["stop_on_error"]:
            break
    report({"done": True})


_harness()
