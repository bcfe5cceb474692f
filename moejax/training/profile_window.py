"""A jax.profiler trace of a window of steps, viewable in TensorBoard or Perfetto."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax


class ProfileWindow:
    """Traces steps [profile.start_step, start_step + num_steps) into DIRECTORY/process_<i>; start_step < 0: never.

    `quiesce` runs before the trace starts and before it stops; the loop passes the checkpointer's wait for its
    asynchronous save. Starting and stopping a trace sets and clears jax's Python tracer in every Python
    thread, while an orbax save starts and ends threads of its own: the test suite's training process died
    with SIGSEGV (no Python error) twice in CI right after a save that was still running when the window
    closed. Waiting costs only the profiled run, outside step time."""

    def __init__(self, profile_cfg, directory: Path, quiesce: Callable[[], None] = lambda: None):
        self.start = profile_cfg.start_step
        self.stop_at = profile_cfg.start_step + profile_cfg.num_steps
        self.directory = Path(directory) / f"process_{jax.process_index()}"
        self.quiesce = quiesce
        self.active = False

    def before_step(self, step: int):
        """Starts or stops the trace as due before `step` is dispatched (slow: keep it out of step time)."""
        if self.start >= 0 and step == self.start and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.quiesce()
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        elif self.active and step == self.stop_at:
            self.stop()

    def stop(self):
        if self.active:
            self.active = False
            try:
                self.quiesce()  # may raise a failed save's error: the trace is still stopped and written
            finally:
                jax.profiler.stop_trace()
