"""When to save: every N steps, every T minutes, at the end, and when SIGTERM/SIGINT asks the run to stop.

Schedulers preempt by sending SIGTERM and, after a grace period, SIGKILL. The handler only records the
signal; the loop saves a checkpoint after the step in flight and exits cleanly. A second signal of the
same kind restores the default action, so an impatient Ctrl-C twice still stops at once.

In a multi-process job every process must save at the same step (the save is collective), but clocks and
signal arrival differ between processes. So the time and signal triggers are agreed on (any process's
trigger counts for all) at the steps where the loop already waits for the device, the logged steps: keep
`train.log_every` steps shorter than the scheduler's grace period.
"""

from __future__ import annotations

import signal
import time

import numpy as np


class StopSignals:
    """Records SIGTERM/SIGINT instead of dying; `received` is the signal number (0: none yet)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = 0
        self._previous = {}

    def __enter__(self):
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received == signum:  # the second time: do what the signal normally does
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.received = signum

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class SaveSchedule:
    """Decides, after each step, whether to save (and whether to stop after saving)."""

    def __init__(self, ckpt_cfg, last_step: int, signals: StopSignals, *, process_count: int = 1):
        self.every_steps = int(ckpt_cfg.every_steps)
        self.every_s = float(ckpt_cfg.every_minutes) * 60
        self.last_step = last_step
        self.signals = signals
        self.process_count = process_count
        self.last_save_time = time.monotonic()

    def fixed(self, step: int) -> bool:
        """A save every process knows about in advance (no agreement needed)."""
        return step == self.last_step or (self.every_steps > 0 and step % self.every_steps == 0)

    def due(self, step: int, *, host_synced: bool) -> tuple[bool, bool]:
        """(save now, stop after saving) for the state after `step` steps."""
        timed = self.every_s > 0 and time.monotonic() - self.last_save_time >= self.every_s
        signalled = self.signals.received != 0
        if self.process_count > 1:
            if not host_synced:
                timed = signalled = False
            else:
                timed, signalled = _any_process(timed, signalled)
        return self.fixed(step) or timed or signalled, signalled

    def saved(self):
        self.last_save_time = time.monotonic()


def _any_process(*flags: bool) -> list[bool]:
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(flags, dtype=np.int32))
    return [bool(x) for x in np.asarray(gathered).reshape(-1, len(flags)).max(axis=0)]
