#!/usr/bin/env python3
"""Start an N-process moejax job on this machine, each process with its own emulated CPU devices.

    python launch/local.py --num_processes 2 --devices_per_process 4 -- \\
        --config configs/tiny.py --workdir runs/tiny-2proc

Every process runs `python -m moejax.train <args> --coordinator 127.0.0.1:PORT --num_processes N
--process_id I`; their collectives go through gloo. Output lines are prefixed with [pI]. When one process
fails the others are stopped, and the launcher exits with the first failure's code; Ctrl-C stops all.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(proc, prefix):
    for line in proc.stdout:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def launch(num_processes: int, devices_per_process: int, train_args: list[str], port: int | None = None,
           python: str = sys.executable) -> int:
    port = port or free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_process}".strip())
    procs = []
    for i in range(num_processes):
        cmd = [python, "-m", "moejax.train", *train_args, "--coordinator", f"127.0.0.1:{port}",
               "--num_processes", str(num_processes), "--process_id", str(i)]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        threading.Thread(target=_pump, args=(p, f"[p{i}]"), daemon=True).start()
        procs.append(p)

    def stop_all(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, sig)

    signal.signal(signal.SIGTERM, lambda *_: stop_all())
    first_failure = 0
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                if p.poll() not in (None, 0) and not first_failure:
                    first_failure = p.returncode
                    time.sleep(2)  # let the others print their own error before they are stopped
                    stop_all()
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130
    for p in procs:
        if p.returncode and not first_failure:
            first_failure = p.returncode
    time.sleep(0.2)  # let the pump threads drain
    return first_failure


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s [--num_processes N] [--devices_per_process D] -- TRAIN_ARGS...")
    ap.add_argument("--num_processes", type=int, default=2)
    ap.add_argument("--devices_per_process", type=int, default=4)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("train_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if not train_args:
        ap.error("give the moejax-train arguments after --")
    return launch(args.num_processes, args.devices_per_process, train_args, args.port)


if __name__ == "__main__":
    sys.exit(main())
