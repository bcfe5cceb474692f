"""Log windows: which finished steps close a window, which of those are written, and what a record holds.

A window closes at a step the host waits for anyway: a logged step (every `log_every`, and the last), an
eval step (eval runs on the state after it), and a fixed save step (a save waits for its step: closing the
window first keeps that wait in step time and only the save itself out of it). Only logged and eval steps
are written; a save step's window is timed and its record dropped.
"""

from __future__ import annotations

from typing import Callable


class LogWindows:
    def __init__(self, *, log_every: int, last_step: int, expert_load_every: int,
                 eval_due: Callable[[int], bool], save_fixed: Callable[[int], bool]):
        self.log_every = log_every
        self.last_step = last_step
        self.expert_load_every = expert_load_every
        self.eval_due = eval_due
        self.save_fixed = save_fixed

    def writes(self, step_done: int) -> bool:
        return step_done % self.log_every == 0 or step_done == self.last_step or self.eval_due(step_done)

    def closes(self, step_done: int) -> bool:
        return self.writes(step_done) or self.save_fixed(step_done)

    def keeps_expert_load(self, step_done: int) -> bool:
        """The full tokens-per-expert matrix is large: only every `expert_load_every` steps and the last."""
        return step_done == self.last_step or (self.expert_load_every > 0 and step_done % self.expert_load_every == 0)

    def record(self, step_done: int, host: dict, throughput: dict, eval_loss: float | None = None) -> dict:
        """The metrics.jsonl record: step, the step's metrics, throughput, then eval loss and expert load."""
        record = {"step": step_done, **{k: v for k, v in host.items() if k != "tokens_per_expert"}, **throughput}
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
        if host.get("tokens_per_expert") is not None and self.keeps_expert_load(step_done):
            record["tokens_per_expert"] = host["tokens_per_expert"]
        return record
