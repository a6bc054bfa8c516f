"""Test harness that runs inside the sandbox (see ``code_tests.py``); never imported by the library.

Its source becomes the sandbox's ``main.py`` (started with process creation allowed, for the fork below).
It reads one JSON payload from stdin before any untrusted code runs: {"nonce", "solution", "setup",
"cases": [{"kind": "expr" | "exec", "src"}], "case_timeout_s", "stop_on_error"}.

The solution never runs in this process. A forked child (the candidate process) closes every descriptor
but two pipes to this process, denies itself process creation and signals, loads setup + solution as a module named
``solution`` (so an ``if __name__ == "__main__":`` block does not run, as when a judge imports it), and answers
requests: evaluate an expression, or call one of its names with plain arguments. Replies carry
``repr`` of values built only of None / bool / int / float / complex / str / bytes / list / tuple / dict /
set; anything else is an error. For each case:
  * "expr": the child evaluates the expression (a call of the solution); its ``repr`` is reported and the
    parent process of the sandbox compares it with the expected value, which never enters the sandbox;
  * "exec": an opaque test program runs here, in a fresh namespace holding the setup, this process's own
    copy of each standard-library module the solution imported (others stay undefined), the solution's
    plain-valued globals, and a proxy for each of its callables that sends plain
    arguments to the child and returns the decoded value. The asserts are judged here, where the
    solution cannot patch builtins, override ``__eq__``, exit early or write reports: it only ever hands
    back data; a built-in exception the solution raises is raised again by the proxy (by type, without
    its arguments). Tests that need the solution's objects themselves (instances, mutated arguments,
    functions passed in, its own exception classes) fail under this scheme.
Each report is one stdout line "<nonce> <json>"; the child holds no descriptor of this stdout. Each case
gets ``case_timeout_s`` of wall time; a child that overruns, dies or answers garbage fails the case and
is replaced (killed, forked again, the solution reloaded) for the next one.
"""


def _harness() -> None:
    import ast
    import builtins
    import importlib
    import io
    import json
    import os
    import resource
    import signal
    import sys
    import types

    payload = json.loads(sys.stdin.read())
    nonce, timeout = payload["nonce"], float(payload["case_timeout_s"])
    here = {os.path.realpath(p) for p in ("", os.getcwd())}
    # Modules imported here come from the installation, never from files the child writes.
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) not in here]
    max_reply = 2 << 20
    plain = (type(None), bool, int, float, complex, str, bytes)
    containers = (list, tuple, set, frozenset)
    unsafe = {"antigravity", "this", "idlelib", "turtle", "turtledemo", "tkinter", "webbrowser", "pydoc"}
    process_events = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                      "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill"}

    class CaseTimeout(BaseException):
        pass

    class CandidateFailed(Exception):
        pass

    def on_alarm(signum, frame):
        raise CaseTimeout()

    def is_plain(value, depth=0) -> bool:
        t = type(value)
        if t in plain:
            return True
        if depth > 50:
            return False
        if t in containers:
            return all(is_plain(v, depth + 1) for v in value)
        if t is dict:
            return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
        return False

    def report(record: dict) -> None:
        os.write(1, (nonce + " " + json.dumps(record) + "\n").encode())

    class Discard(io.TextIOBase):  # the sandbox may not open /dev/null for writing
        def write(self, text):
            return len(text)

    # ---- the candidate process: untrusted from the moment the solution is loaded ----
    def confine() -> None:
        """The kernel's rules, where the sandbox has them: the candidate starts no process and cannot trace this
        process, which holds the nonce (seccomp; the directory is already the run's own Landlock layer's). Fails
        closed: the solution never runs unconfined."""
        layer = globals().get("__sandbox_confine__")
        if layer is not None:
            try:
                layer(os.getcwd(), False, False)
            except Exception:  # noqa: BLE001
                os._exit(125)

    def serve(requests: int, replies: int) -> None:
        def deny(event, args):
            if event in process_events or (event == "import" and args and args[0] == "_posixsubprocess"):
                raise PermissionError(f"sandbox: {event} is not allowed in the candidate process")

        sys.addaudithook(deny)
        sys.stdout = sys.stderr = Discard()
        sys.stdin = io.StringIO("")
        reader = os.fdopen(requests, "rb")

        def send(record: dict) -> None:
            os.write(replies, (json.dumps(record) + "\n").encode())

        def encode(value) -> dict:
            if not is_plain(value):
                return {"error": "unsupported type " + type(value).__name__}
            text = repr(value)
            return {"value": text} if len(text) <= max_reply // 2 else {"error": "value too large"}

        # Loaded as a module, not as the main program (as function-call judges import a solution): a main block that
        # reads input or runs an example does not run, and the functions above it are what the cases call.
        namespace = {"__name__": "solution", "__builtins__": builtins}
        try:
            exec(compile(payload["setup"] + "\n" + payload["solution"], "solution.py", "exec"), namespace)
        except BaseException as e:  # noqa: BLE001 - SystemExit at import time fails every case
            send({"load_error": type(e).__name__ + ": " + str(e)[:200]})
            os._exit(0)
        exports = []
        for name, value in list(namespace.items()):
            if name.startswith("__") or not name.isidentifier():
                continue
            if isinstance(value, types.ModuleType):
                exports.append([name, "module", str(value.__name__)])
            elif callable(value):
                exports.append([name, "callable", ""])
            elif is_plain(value):
                exports.append([name, "value", repr(value)[:100_000]])
        send({"exports": exports})
        for line in reader:
            try:
                request = json.loads(line)
                if request["op"] == "eval":
                    value = eval(compile(request["src"], "test.py", "eval"), namespace)
                else:
                    value = namespace[request["name"]](*ast.literal_eval(request["args"]),
                                                       **ast.literal_eval(request["kwargs"]))
                record = encode(value)
            except BaseException as e:  # noqa: BLE001 - SystemExit inside a call is that call's failure
                record = {"error": type(e).__name__}
            send(record)
        os._exit(0)

    # ---- this process: trusted; talks to the child through its two pipes ----
    child = {}

    def start() -> None:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                confine()
                keep = sorted((requests_r, replies_w))
                limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                os.closerange(0, keep[0])
                os.closerange(keep[0] + 1, keep[1])
                os.closerange(keep[1] + 1, limit if limit > 0 else 1 << 20)
                serve(requests_r, replies_w)
            finally:
                os._exit(1)
        os.close(requests_r)
        os.close(replies_w)
        child.update(pid=pid, requests=requests_w, replies=replies_r, buffer=b"")

    def stop() -> None:
        if child:
            for fd in (child["requests"], child["replies"]):
                os.close(fd)
            try:
                os.kill(child["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(child["pid"], 0)
            child.clear()

    def receive() -> dict:
        while b"\n" not in child["buffer"]:
            chunk = os.read(child["replies"], 65536)
            if not chunk or len(child["buffer"]) > max_reply:
                stop()
                raise CandidateFailed("no reply")
            child["buffer"] += chunk
        line, child["buffer"] = child["buffer"].split(b"\n", 1)
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            stop()
            raise CandidateFailed("garbled reply")
        return record

    def ask(request: dict) -> dict:
        try:
            os.write(child["requests"], (json.dumps(request) + "\n").encode())
        except OSError:
            stop()
            raise CandidateFailed("no reply") from None
        return receive()

    def load() -> list:
        """Starts a candidate process; its exports, or CandidateFailed naming why it did not load."""
        start()
        record = receive()
        if "load_error" in record:
            stop()
            raise CandidateFailed(str(record["load_error"]))
        exports = record.get("exports")
        return exports if isinstance(exports, list) else []

    def value_of(record: dict):
        text = record.get("value")
        if isinstance(text, str):
            return ast.literal_eval(text)
        error = str(record.get("error", "no value"))[:200]
        raised = getattr(builtins, error, None)  # a built-in exception reaches tests that expect it
        if isinstance(raised, type) and issubclass(raised, Exception):
            raise raised("raised by the solution")
        raise CandidateFailed(error)

    def proxy(name: str):
        def call(*args, **kwargs):
            if not (is_plain(args) and is_plain(kwargs)):
                raise TypeError(f"only plain values can be passed to the solution's {name}")
            if not child:
                load()
            return value_of(ask({"op": "call", "name": name, "args": repr(args), "kwargs": repr(kwargs)}))
        call.__name__ = call.__qualname__ = name
        return call

    def test_namespace(exports: list) -> dict:
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        exec(compile(payload["setup"], "setup.py", "exec"), namespace)
        for item in exports:
            if not (isinstance(item, list) and len(item) == 3 and all(isinstance(x, str) for x in item)):
                continue
            name, kind, data = item
            if not name.isidentifier() or name.startswith("__"):
                continue
            try:
                if kind == "module":  # the standard library's module of that name, never the child's object
                    if data.split(".")[0] not in sys.stdlib_module_names or data.split(".")[0] in unsafe:
                        continue
                    namespace[name] = importlib.import_module(data)
                elif kind == "value":
                    namespace[name] = ast.literal_eval(data)
                elif kind == "callable":
                    namespace[name] = proxy(name)
            except Exception:  # noqa: BLE001 - a name the tests cannot use here stays undefined
                pass
        return namespace

    signal.signal(signal.SIGALRM, on_alarm)
    sys.stdout = sys.stderr = Discard()  # what test programs print; reports go straight to descriptor 1
    sys.stdin = io.StringIO("")
    cases = payload["cases"]
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout * max(1, len(cases)))
        exports = load()
        signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as e:  # noqa: BLE001 - CaseTimeout, CandidateFailed: every case fails
        signal.setitimer(signal.ITIMER_REAL, 0)
        stop()
        report({"load_error": type(e).__name__ + ": " + str(e)[:200]})
        return
    for i, case in enumerate(cases):
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            if not child:
                exports = load()
            if case["kind"] == "expr":
                record = ask({"op": "eval", "src": case["src"]})
                text = record.get("value")
                if isinstance(text, str):
                    record = {"i": i, "status": "ok", "value": text}
                else:
                    record = {"i": i, "status": "error", "detail": str(record.get("error", "no value"))[:200]}
            else:
                exec(compile(case["src"], "test.py", "exec"), test_namespace(exports))
                record = {"i": i, "status": "ok"}
            signal.setitimer(signal.ITIMER_REAL, 0)
        except CaseTimeout:
            stop()
            record = {"i": i, "status": "timeout"}
        except BaseException as e:  # noqa: BLE001 - SystemExit inside a test is a failure
            signal.setitimer(signal.ITIMER_REAL, 0)
            record = {"i": i, "status": "error", "detail": type(e).__name__}
        report(record)
        if record["status"] != "ok" and payload["stop_on_error"]:
            break
    stop()
    report({"done": True})


_harness()
