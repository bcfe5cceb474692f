"""A watchdog thread: if no step finishes for `timeout_s`, print where every thread is and exit non-zero.

A hung collective (a dead peer, a stuck NCCL/gloo op) or a deadlocked input thread otherwise holds a whole
job's GPUs forever without a word. The loop calls `beat()` whenever it sees progress; the thread checks
every few seconds and, on a stall, writes all Python thread stacks (faulthandler) to stderr and ends the
process with `os._exit` (a stuck main thread would never see an exception).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

STALL_EXIT_CODE = 5


class Watchdog:
    def __init__(self, timeout_s: float, *, what: str = "step", poll_s: float | None = None):
        self.timeout_s = float(timeout_s)
        self.what = what
        self._poll_s = poll_s if poll_s is not None else min(5.0, max(0.05, self.timeout_s / 10))
        self._last = time.monotonic()
        self._label = "start"
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> "Watchdog":
        if self.timeout_s > 0:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="moejax-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, label: str | int = ""):
        """Progress: the clock restarts; the label says where the run was, for the stall message."""
        self._last = time.monotonic()
        self._label = str(label)

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self):
        while not self._stop.wait(self._poll_s):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                sys.stderr.write(f"\nmoejax watchdog: no {self.what} finished for {idle:.0f}s (limit "
                                 f"{self.timeout_s:g}s; last progress: {self._label}); stacks of every thread:\n")
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.write(f"moejax watchdog: exiting with code {STALL_EXIT_CODE} "
                                 "(raise guards.step_timeout_s if steps are legitimately this slow)\n")
                sys.stderr.flush()
                os._exit(STALL_EXIT_CODE)
