"""Start N cooperating processes of the main job on this host (CPU devices, gloo collectives).

    python launchers/local.py --num_processes=2 --devices_per_process=2 -- \
        --config=configs/math.py --config.mesh.train_devices=1 --config.mesh.rollout_devices=1

Each process gets its own share of CPU devices (XLA_FLAGS; PJRT_NPROC sizes its thread pools for them,
runtime.host_devices), the coordinator address on a free local port, and its id through the AREAL_* variables
areal_jax.runtime.distributed reads; its output goes to <log_dir>/process_<i>.log (process 0 is also echoed to this
console). If any process dies, the others are killed with SIGKILL (jax.distributed catches SIGTERM and could hang in
a collective) and this launcher exits with the first non-zero code.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from areal_jax.runtime.host_devices import host_device_env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, stop: threading.Event) -> None:
    while not os.path.exists(path) and not stop.is_set():
        time.sleep(0.1)
    with open(path, errors="replace") as f:
        while not stop.is_set():
            line = f.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                time.sleep(0.1)
        sys.stdout.write(f.read())


def launch(num_processes: int, devices_per_process: int, job_args: list[str], log_dir: str,
           module: str = "areal_jax.main", timeout_s: float | None = None, echo: bool = True) -> int:
    """Run the processes to completion; returns 0 if all succeeded, else the first failure's code."""
    os.makedirs(log_dir, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    procs, logs = [], []
    for i in range(num_processes):
        env = dict(os.environ)
        env.update({
            "AREAL_COORDINATOR": address, "AREAL_NUM_PROCESSES": str(num_processes), "AREAL_PROCESS_ID": str(i),
            "JAX_PLATFORMS": "cpu", **host_device_env(devices_per_process, env),
        })
        log_path = os.path.join(log_dir, f"process_{i}.log")
        log = open(log_path, "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", module, *job_args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    stop_tail = threading.Event()
    tail = None
    if echo:
        tail = threading.Thread(target=_tail, args=(os.path.join(log_dir, "process_0.log"), stop_tail), daemon=True)
        tail.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                print(f"process {i} exited with code {code}; stopping the others "
                      f"(see {os.path.join(log_dir, f'process_{i}.log')}).", file=sys.stderr, flush=True)
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"timed out after {timeout_s:.0f} s; killing every process.", file=sys.stderr, flush=True)
                code = 124
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        code = 130
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        stop_tail.set()
        if tail is not None:
            tail.join(timeout=2)
        for log in logs:
            log.close()
    return code


def main() -> None:
    argv = sys.argv[1:]
    job_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, job_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=2)
    parser.add_argument("--log_dir", default="runs/local_launch_logs")
    parser.add_argument("--module", default="areal_jax.main")
    parser.add_argument("--timeout_s", type=float, default=None)
    args = parser.parse_args(argv)
    sys.exit(launch(args.num_processes, args.devices_per_process, job_args, args.log_dir, args.module,
                    args.timeout_s))


if __name__ == "__main__":
    main()
