"""Noticing that another process of the job is gone, and leaving at once with exit code 6.

When a process of a multi-process job dies (SIGKILL, a lost node), the survivors learn it in one of three ways:
- a collective fails (gloo between CPU processes: "Connection closed by peer" within a second);
- a collective hangs (NCCL usually waits: the watchdog's step_timeout_s would end it, exit 5, after up to 30 min);
- jax's coordination service misses the dead process's heartbeats for 100 s and aborts every survivor
  (SIGABRT: exit 134 with a C++ stack, also when a survivor is merely shutting down).
moejax's own detection comes first: each process bumps a counter in the coordination service's key-value store
every few seconds, and a thread reads everyone's; a counter that stops moving for `guards.peer_timeout_s` (or a
coordination service that no longer answers: process 0 is gone) ends the process with one line and exit code 6,
before jax's abort and without its shutdown barrier (which would wait for the dead process). A failed collective
is also reported as exit 6 (moejax.cli.train). A supervisor (`launch/local.py --max_restarts`, SLURM's retry loop,
the JobSet's restart policy) then restarts the job, which resumes from the newest checkpoint.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

from moejax.training.restart_policy import LOST_PEER as LOST_PEER_EXIT_CODE
KEY = "moejax/alive/"


# How a collective reports that the process at its other end is gone (gloo between CPU processes; NCCL; jax's
# coordination service). A lost peer is the likely cause of these in a multi-process job, not a bug to debug.
PEER_LOSS_SIGNS = ("connection reset by peer", "connection closed by peer", "broken pipe", "remote process exited",
                   "ncclremoteerror", "heartbeat timeout", "stopped sending heartbeats")


class LostPeer(RuntimeError):
    """A collective failed because another process of the job is gone."""


def as_lost_peer(error: BaseException) -> LostPeer | None:
    """error as a LostPeer when it is a runtime error of a multi-process job that says its peer is gone."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if jax.process_count() > 1 and isinstance(error, jax.errors.JaxRuntimeError) and any(
            sign in str(error).lower() for sign in PEER_LOSS_SIGNS):
        return LostPeer(f"a collective failed: {first[:200]}")
    return None


def lost_peer_exit(why: str):
    """One line, then exit 6 at once (os._exit: jax's shutdown would wait for the dead process's heartbeat)."""
    sys.stderr.write(f"moejax-train: lost a peer process: {why}; exiting with code {LOST_PEER_EXIT_CODE} (restart "
                     "the job: it resumes from the newest checkpoint)\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(LOST_PEER_EXIT_CODE)


class PeerMonitor:
    """Two daemon threads: one beats and reads everyone's counters through the coordination service (its calls
    block while process 0, which hosts the service, is frozen or unreachable), one judges what it last heard."""

    def __init__(self, timeout_s: float, *, poll_s: float | None = None):
        self.timeout_s = float(timeout_s)
        self.poll_s = poll_s if poll_s is not None else max(0.2, min(5.0, self.timeout_s / 6))
        self._stop = threading.Event()
        self._threads = []
        self._answered_at = time.monotonic()  # the coordination service's last answer
        self._values: dict[str, str] = {}

    def start(self) -> "PeerMonitor":
        if self.timeout_s > 0 and jax.process_count() > 1:
            from jax._src import distributed as jax_distributed

            self._client = jax_distributed.global_state.client
            self._answered_at = time.monotonic()
            for target, name in ((self._beat, "moejax-peer-heartbeat"), (self._judge, "moejax-peer-monitor")):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def stop(self):
        self._stop.set()
        # the judge stops at once; the beating thread may sit in a call to a dead service: left behind (daemon)
        for thread in self._threads[1:]:
            thread.join()

    def _beat(self):
        me, beats = jax.process_index(), 0
        while not self._stop.wait(self.poll_s):
            try:
                beats += 1
                self._client.key_value_set(f"{KEY}{me}", str(beats), allow_overwrite=True)
                self._values = dict(self._client.key_value_dir_get(KEY))
                self._answered_at = time.monotonic()
            except Exception as e:  # noqa: BLE001 - any failure here means the coordination service is gone
                if not self._stop.is_set():
                    first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
                    lost_peer_exit(f"the job's coordination service (on process 0) failed ({first})")
                return

    def _judge(self):
        me, n = jax.process_index(), jax.process_count()
        last_seen, changed_at = {}, {}
        start = time.monotonic()
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            if now - self._answered_at > self.timeout_s and not self._stop.is_set():
                lost_peer_exit(f"the job's coordination service (on process 0) did not answer for "
                               f"{now - self._answered_at:.0f}s (guards.peer_timeout_s={self.timeout_s:g})")
            values = self._values
            for p in range(n):
                if p == me:
                    continue
                value = values.get(f"{KEY}{p}")
                if value != last_seen.get(p):
                    last_seen[p], changed_at[p] = value, now
                quiet = now - changed_at.get(p, start)
                if quiet > self.timeout_s and not self._stop.is_set():
                    lost_peer_exit(f"process {p} sent no heartbeat for {quiet:.0f}s (guards.peer_timeout_s="
                                   f"{self.timeout_s:g})")
