"""A jax.profiler trace of a window of steps, viewable in TensorBoard or Perfetto."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax


class ProfileWindow:
    """Traces steps [profile.start_step, start_step + num_steps) into DIRECTORY/process_<i>; start_step < 0: never.

    The trace holds the device ops and the host's annotations (each step's StepTraceAnnotation, jit
    dispatch); jax's Python tracer, which also records every Python call in every thread, only with
    profile.python_tracer. It is off by default for two reasons: its per-call cost lands in the traced steps,
    and starting and stopping it sets and clears a profile hook in every Python thread while orbax's
    asynchronous save starts and ends threads of its own: the test suite's training process (Python tracer
    on, jax's default then) died with SIGSEGV, no Python error, twice in CI right after a save that was still
    running when the window closed.

    `quiesce` runs before the trace starts and before it stops; the loop passes the checkpointer's wait for
    its asynchronous save, so no save runs across a start or a stop. Waiting costs only the profiled run,
    outside step time."""

    def __init__(self, profile_cfg, directory: Path, quiesce: Callable[[], None] = lambda: None):
        self.start = profile_cfg.start_step
        self.stop_at = profile_cfg.start_step + profile_cfg.num_steps
        self.directory = Path(directory) / f"process_{jax.process_index()}"
        self.python_tracer = bool(profile_cfg.python_tracer)
        self.quiesce = quiesce
        self.active = False

    def before_step(self, step: int):
        """Starts or stops the trace as due before `step` is dispatched (slow: keep it out of step time)."""
        if self.start >= 0 and step == self.start and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.quiesce()
            jax.profiler.start_trace(str(self.directory), profiler_options=self.options())
            self.active = True
        elif self.active and step == self.stop_at:
            self.stop()

    def options(self) -> jax.profiler.ProfileOptions:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 1 if self.python_tracer else 0  # 0: no Python call events
        return options

    def stop(self):
        if self.active:
            self.active = False
            try:
                self.quiesce()  # may raise a failed save's error: the trace is still stopped and written
            finally:
                jax.profiler.stop_trace()
