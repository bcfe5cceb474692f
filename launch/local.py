#!/usr/bin/env python3
"""Start an N-process moejax job on this machine, each process with its own emulated CPU devices.

    python launch/local.py --num_processes 2 --devices_per_process 4 -- \\
        --config configs/tiny.py --workdir runs/tiny-2proc

Every process runs `python -m moejax.train <args> --coordinator 127.0.0.1:PORT --num_processes N
--process_id I`; their collectives go through gloo. Output lines are prefixed with [pI]. When one process
fails the others are stopped, and the launcher exits with the first failure's code; Ctrl-C stops all.

With --max_restarts N it supervises: after a failure a restart can help with (a lost process, a crash, a hang;
not bad input or non-finite losses: moejax/training/restart_policy.py) it starts every process again, up to N
times, and logs each restart's cause and the step the job resumed at ("[launch] ..." lines).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from moejax.training.restart_policy import LOST_PEER, cause, should_restart


KILL_AFTER_S = 5  # after a failure, the others get SIGTERM (a survivor is left with a dead peer), then SIGKILL
# After a failure, how long the others may take to print their own error and exit by themselves (a survivor exits 6
# on its next collective) before they are stopped; MOEJAX_LAUNCH_GRACE_S overrides it (tests on a loaded machine).
GRACE_S = float(os.environ.get("MOEJAX_LAUNCH_GRACE_S", "2"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Restarts:
    """What the supervisor tells about a restart once the new job shows where it resumed."""

    def __init__(self):
        self.pending = None  # (restart number, time of the failure) until process 0 prints its start banner

    def watch(self, line: str):
        match = re.search(r"resumed at step (\d+)", line) if self.pending else None
        if self.pending and (match or " compiled in " in line):
            n, failed_at = self.pending
            self.pending = None
            where = f"step {match.group(1)}" if match else "step 0 (no checkpoint)"
            print(f"[launch] restart {n}: training again from {where}, {time.monotonic() - failed_at:.1f}s after the "
                  "failure", flush=True)


def _pump(proc, prefix, restarts: _Restarts | None = None):
    for line in proc.stdout:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()
        if restarts is not None:
            restarts.watch(line)


def launch(num_processes: int, devices_per_process: int, train_args: list[str], port: int | None = None,
           python: str = sys.executable, restarts: _Restarts | None = None) -> tuple[int, int | None]:
    """Runs the job once: (the first failure's exit code, or 0; the index of the process that failed first)."""
    port = port or free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_process}".strip())
    procs = []
    for i in range(num_processes):
        cmd = [python, "-m", "moejax.train", *train_args, "--coordinator", f"127.0.0.1:{port}",
               "--num_processes", str(num_processes), "--process_id", str(i)]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        print(f"[launch] process {i}: pid {p.pid}", flush=True)
        threading.Thread(target=_pump, args=(p, f"[p{i}]", restarts if i == 0 else None), daemon=True).start()
        procs.append(p)

    stopping = []

    def stop_all(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, sig)

    def on_sigterm(*_):
        stopping.append(True)
        stop_all()

    signal.signal(signal.SIGTERM, on_sigterm)
    first_failure, failed, stopped_at = 0, None, 0.0
    try:
        while any(p.poll() is None for p in procs):
            if not first_failure and any(p.poll() not in (None, 0) for p in procs):
                grace_end = time.monotonic() + GRACE_S  # the others print their own error and may exit by themselves
                while time.monotonic() < grace_end and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                failures = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                # a process that left because its peer was lost (6) reports a consequence: name the peer's exit
                failed, first_failure = next((f for f in failures if f[1] != LOST_PEER), failures[0])
                stop_all()
                stopped_at = time.monotonic()
            elif first_failure and time.monotonic() - stopped_at > KILL_AFTER_S:
                stop_all(signal.SIGKILL)  # a frozen or hung process does not act on SIGTERM
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130, None
    failures = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
    if failures and not first_failure:  # every process ended at once
        failed, first_failure = next((f for f in failures if f[1] != LOST_PEER), failures[0])
    time.sleep(0.2)  # let the pump threads drain
    if stopping:  # the supervisor itself was asked to stop: a stop, whatever the processes said
        return 143, None
    return first_failure, failed


def supervise(num_processes: int, devices_per_process: int, train_args: list[str], max_restarts: int,
              port: int | None = None) -> int:
    """Runs the job; after a failure a restart would help with (moejax.training.restart_policy), starts every
    process again, up to max_restarts times. Each restart is logged with its cause and the step it resumed at."""
    restarts = _Restarts()
    for attempt in range(max_restarts + 1):
        code, failed = launch(num_processes, devices_per_process, train_args, port, restarts=restarts)
        if code == 0 or not should_restart(code):
            return code
        who = f"process {failed}" if failed is not None else "the job"
        if attempt == max_restarts:
            print(f"[launch] {who} exited with {code} ({cause(code)}); no restarts left (--max_restarts "
                  f"{max_restarts})", flush=True)
            return code
        print(f"[launch] {who} exited with {code} ({cause(code)}); restart {attempt + 1}/{max_restarts}",
              flush=True)
        restarts.pending = (attempt + 1, time.monotonic())
    return code


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s [--num_processes N] [--devices_per_process D] -- TRAIN_ARGS...")
    ap.add_argument("--num_processes", type=int, default=2)
    ap.add_argument("--devices_per_process", type=int, default=4)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--max_restarts", type=int, default=0,
                    help="restart every process after a failure a restart can help with (a lost process, a crash, "
                         "a hang), up to N times; the job resumes from its newest checkpoint (default 0: none)")
    ap.add_argument("train_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if not train_args:
        ap.error("give the moejax-train arguments after --")
    return supervise(args.num_processes, args.devices_per_process, train_args, args.max_restarts, args.port)


if __name__ == "__main__":
    sys.exit(main())
