"""Held-out evaluation: when it is due, and the mean loss of the compiled eval step over the held-out batches."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np


class Evaluator:
    """`eval_fn(state, device_batch) -> loss` over `held_out` (host batches, put on the devices by
    `to_device`), every `every` steps and after the last; never when there is nothing held out or every <= 0."""

    def __init__(self, eval_fn: Callable | None, held_out: list, *, every: int, last_step: int,
                 to_device: Callable = lambda batch: batch):
        self.eval_fn = eval_fn
        self.held_out = held_out
        self.every = every
        self.last_step = last_step
        self.to_device = to_device

    def due(self, step_done: int) -> bool:
        return bool(self.held_out) and self.every > 0 and (step_done % self.every == 0 or step_done == self.last_step)

    def run(self, state) -> float:
        """The mean loss over the held-out batches; blocks until they are all evaluated."""
        losses = [self.eval_fn(state, self.to_device(batch)) for batch in self.held_out]
        return float(np.mean(jax.device_get(losses)))
