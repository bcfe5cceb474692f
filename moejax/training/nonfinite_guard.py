"""The non-finite guard: counts steps the train step skipped (non-finite loss or gradient) and stops the run
after `guards.max_bad_steps` in a row.

The step itself decides to skip (it applies no update), so one bad batch costs one step; here the host only
counts. A run of bad steps means the state or the data is poisoned, so the run stops without saving: the
last checkpoint, from before the run of bad steps, stays the one to resume from.
"""

from __future__ import annotations

import sys
from typing import Callable


class NonFiniteLoss(RuntimeError):
    """guards.max_bad_steps consecutive steps had a non-finite loss or gradient."""


class NonFiniteGuard:
    """`in_a_row`: the current run of skipped steps, from `first_bad`; `total`: every skipped step of the
    training run, resumes included (a checkpoint's `skipped_steps`)."""

    def __init__(self, max_bad_steps: int, *, total: int = 0,
                 latest_checkpoint: Callable[[], int | None] = lambda: None):
        self.max_bad_steps = max_bad_steps
        self.latest_checkpoint = latest_checkpoint
        self.in_a_row = 0
        self.first_bad = None
        self.total = total

    def observe(self, step_done: int, skipped: bool, loss=None, grad_norm=None) -> str | None:
        """Counts step_done; returns why the run must stop (None: it goes on). A skipped step is reported on
        stderr as it is seen, since the logged records may not include it."""
        if not skipped:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row == 1:
            self.first_bad = step_done
        print(f"step {step_done}: loss {loss} / grad norm {grad_norm} is not finite; the update was skipped "
              f"({self.in_a_row} in a row, {self.total} in this run)", file=sys.stderr, flush=True)
        if self.in_a_row >= self.max_bad_steps:
            kept = self.latest_checkpoint()  # asked only now: it may list the checkpoint directory
            return (
                f"{self.in_a_row} consecutive steps ({self.first_bad}-{step_done}) had a non-finite loss or gradient "
                f"(guards.max_bad_steps={self.max_bad_steps}); no update was applied and nothing was saved after "
                + (f"checkpoint step {kept}, which is intact" if kept else "the start (there is no checkpoint)"))
        return None
