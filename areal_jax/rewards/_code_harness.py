"""Test harness that runs inside the sandbox (see ``code_tests.py``); never imported by the library.

Its source becomes the sandbox's ``main.py``. It reads one JSON payload from stdin before any untrusted
code runs: {"nonce", "solution", "setup", "cases": [{"kind": "expr" | "exec", "src"}], "case_timeout_s",
"stop_on_error"}. It then executes the solution in a fresh namespace and, for each case:
  * "expr": evaluates the expression (a call of the solution) and reports ``repr`` of its value when the
    value is built only of None / bool / int / float / complex / str / bytes / list / tuple / dict / set;
    the parent compares it with the expected value, which never enters this process;
  * "exec": executes test statements (an opaque assert program) and reports whether they raised.
Each report is one stdout line "<nonce> <json>" written through a file descriptor captured before the
solution runs; everything the solution prints is discarded. Each case gets ``case_timeout_s`` of
wall time (an interval timer); a case that raises anything, SystemExit included, fails.
"""


def _harness() -> None:
    import io
    import json
    import os
    import signal
    import sys

    payload = json.loads(sys.stdin.read())
    nonce = payload["nonce"]
    out_fd = os.dup(1)
    write, dumps, repr_, type_ = os.write, json.dumps, repr, type
    str_, len_, BaseException_ = str, len, BaseException
    plain = (type(None), bool, int, float, complex, str, bytes)
    containers = (list, tuple, set, frozenset)

    class CaseTimeout(BaseException):
        pass

    def on_alarm(signum, frame):
        raise CaseTimeout()

    def is_plain(value, depth=0) -> bool:
        t = type_(value)
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
        write(out_fd, (nonce + " " + dumps(record) + "\n").encode())

    class Discard(io.TextIOBase):  # the sandbox may not open /dev/null for writing
        def write(self, text):
            return len_(text)

    sys.stdout = sys.stderr = Discard()
    sys.stdin = io.StringIO("")
    signal.signal(signal.SIGALRM, on_alarm)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    timeout = float(payload["case_timeout_s"])
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout * max(1, len_(payload["cases"])))
        exec(compile(payload["setup"] + "\n" + payload["solution"], "solution.py", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException_ as e:  # noqa: BLE001 - SystemExit at import time fails every case
        signal.setitimer(signal.ITIMER_REAL, 0)
        report({"load_error": type_(e).__name__ + ": " + str_(e)[:200]})
        return
    for i, case in enumerate(payload["cases"]):
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            if case["kind"] == "expr":
                value = eval(compile(case["src"], "test.py", "eval"), namespace)
                signal.setitimer(signal.ITIMER_REAL, 0)
                if not is_plain(value):
                    record = {"i": i, "status": "error", "detail": "unsupported type " + type_(value).__name__}
                else:
                    text = repr_(value)
                    if len_(text) > 1_000_000:
                        record = {"i": i, "status": "error", "detail": "value too large"}
                    else:
                        record = {"i": i, "status": "ok", "value": text}
            else:
                exec(compile(case["src"], "test.py", "exec"), namespace)
                signal.setitimer(signal.ITIMER_REAL, 0)
                record = {"i": i, "status": "ok"}
        except CaseTimeout:
            record = {"i": i, "status": "timeout"}
        except BaseException_ as e:  # noqa: BLE001 - SystemExit inside a test is a failure
            signal.setitimer(signal.ITIMER_REAL, 0)
            record = {"i": i, "status": "error", "detail": type_(e).__name__}
        report(record)
        if record["status"] != "ok" and payload["stop_on_error"]:
            break
    report({"done": True})


_harness()
