"""Step time: the wall time of a log window divided by the steps in it, less the host time excluded.

The loop reads metrics only at the end of a window (the last step's completion), so per-step wall times
are not observable without stalling the device; a window's average is. Host work that is not a training
step (eval, checkpoint saves, starting or stopping the profiler, W&B logging) happens inside the window and is
excluded, so it does not show up as a slower step or a lower MFU.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class StepTimer:
    """Times windows of steps; a window opens at construction (or the last close) and closes at a step."""

    def __init__(self, start_step: int, *, clock=time.perf_counter):
        self._clock = clock
        self._opened_at = clock()
        self._opened_step = start_step
        self._excluded = 0.0

    def exclude(self, seconds: float):
        """Seconds of host time inside the current window that were not spent on training steps."""
        self._excluded += seconds

    @contextmanager
    def excluding(self):
        began = self._clock()
        try:
            yield
        finally:
            self.exclude(self._clock() - began)

    def close_window(self, step_done: int) -> float:
        """Closes the window at `step_done` (just completed); returns its seconds per step and opens the next."""
        now = self._clock()
        step_time = (now - self._opened_at - self._excluded) / max(1, step_done - self._opened_step)
        self._opened_at, self._opened_step, self._excluded = now, step_done, 0.0
        return step_time
