"""A jax.profiler trace of a window of steps, viewable in TensorBoard or Perfetto."""

from __future__ import annotations

from pathlib import Path

import jax


class ProfileWindow:
    """Traces steps [profile.start_step, start_step + num_steps) into DIRECTORY/process_<i>; start_step < 0: never."""

    def __init__(self, profile_cfg, directory: Path):
        self.start = profile_cfg.start_step
        self.stop_at = profile_cfg.start_step + profile_cfg.num_steps
        self.directory = Path(directory) / f"process_{jax.process_index()}"
        self.active = False

    def before_step(self, step: int):
        """Starts or stops the trace as due before `step` is dispatched (slow: keep it out of step time)."""
        if self.start >= 0 and step == self.start and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        elif self.active and step == self.stop_at:
            self.stop()

    def stop(self):
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
