"""Which checkpoint a resume restores: the newest in WORKDIR/checkpoints that passes its integrity check
(checkpoint_integrity.py) and whose small items (config, meta) read back.

A newer one that fails is passed over with one line on stderr (checkpoint.on_bad_checkpoint='fall_back', the
default) or refuses the run ('refuse': exit 2 naming it). Never from scratch while checkpoints exist: when none
passes, the run exits 2 naming them all.

It runs before anything compiles (api.prepare_training), on every process of a job: each reads the same shared
files and comes to the same choice. Process 0 then moves the passed-over checkpoints to WORKDIR/bad_checkpoints/,
before any process opens its orbax manager: orbax would refuse to save their steps again, and a person may want
to look at them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import orbax.checkpoint as ocp

from moejax.config.changes import Continuation, changed_fields
from moejax.training.checkpoint import CheckpointError, error_summary, orbax_manager
from moejax.training.checkpoint_integrity import verify

BAD_DIR = "bad_checkpoints"


@dataclass(frozen=True)
class ResumePoint:
    step: int
    saved_config: dict  # the resolved config of the run that saved it
    verified: bool  # False: saved before moejax wrote integrity manifests, restored unchecked
    passed_over: tuple[tuple[int, str], ...] = ()  # (step, why) of the newer checkpoints that failed, newest first


def _steps(directory: Path, manager) -> list[int]:
    """Newest first: orbax's steps and every directory named by a step (orbax may not list an emptied one, which
    must still be reported and moved out of the way of the step's next save)."""
    on_disk = {int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()}
    return sorted(on_disk | set(manager.all_steps()), reverse=True)


def inspect_workdir(workdir: Path, on_bad: str = "fall_back") -> ResumePoint | None:
    """The checkpoint WORKDIR's run resumes from, or None when there are none; CheckpointError when none passes, or
    when the newest fails and on_bad is 'refuse'. Reads every file of the checkpoints it checks (their CRC32s) and
    orbax's small JSON items; nothing is compiled."""
    directory = Path(workdir) / "checkpoints"
    if not directory.is_dir():
        return None
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # orbax warns that a read-only manager is read-only
    manager = orbax_manager(directory, read_only=True)
    try:
        steps, failed = _steps(directory, manager), []
        for step in steps:
            verdict = verify(directory / str(step))
            problem = verdict.problem
            if not problem:
                try:
                    restored = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore(),
                                                                             meta=ocp.args.JsonRestore()))
                    return ResumePoint(step, dict(restored.config), verdict.verified, tuple(failed))
                except Exception as e:
                    problem = error_summary(e)
            failed.append((step, problem))
            if on_bad == "refuse":
                older = [s for s in steps if s < step]
                raise CheckpointError(
                    f"checkpoint {directory / str(step)} is incomplete or corrupt ({problem}); with "
                    f"checkpoint.on_bad_checkpoint='refuse', move it out of {directory} to resume from "
                    + (f"step {older[0]}" if older else "scratch"))
        if not failed:
            return None
        raise CheckpointError(f"no checkpoint in {directory} passes its integrity check: "
                              + "; ".join(f"{step} ({why})" for step, why in failed)
                              + f"; move them out of {directory} to start from scratch")
    finally:
        manager.close()
        absl_logger.setLevel(level)


def incompatibilities(saved_config: dict, config: dict) -> list[str]:
    """'field=saved there, new here' for each field whose change would break the resume: a state of another
    shape, or another order of data (moejax.config.changes, RESUME)."""
    return [f"{f}={saved!r} there, {new!r} here"
            for f, saved, new in changed_fields(saved_config, config, Continuation.RESUME)]


def check_resumable(workdir: Path, config_json: str, on_bad: str = "fall_back") -> ResumePoint | None:
    """The checkpoint this config resumes WORKDIR's run from (None: a new run); raises CheckpointError if WORKDIR
    holds a run this config cannot continue or no checkpoint that may be restored."""
    point = inspect_workdir(workdir, on_bad)
    if point is None:
        return None
    problems = incompatibilities(point.saved_config, json.loads(config_json))
    if problems:
        raise CheckpointError(f"--workdir {workdir} holds an incompatible run (checkpoint at step {point.step}): "
                              f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                              + "; use a new --workdir or the saved values")
    return point


def set_aside_passed_over(workdir: Path, point: ResumePoint | None) -> list[str]:
    """Moves the checkpoints the resume passed over to WORKDIR/bad_checkpoints/ (process 0 only); returns the lines
    that say so, and the notice for an unverified restore, for stderr."""
    if point is None:
        return []
    directory, lines = Path(workdir) / "checkpoints", []
    for step, why in point.passed_over:
        target = Path(workdir) / BAD_DIR / str(step)
        n = 0
        while target.exists():  # the same step failed before
            n += 1
            target = target.with_name(f"{step}.{n}")
        target.parent.mkdir(exist_ok=True)
        (directory / str(step)).rename(target)
        lines.append(f"checkpoint {directory / str(step)} is incomplete or corrupt ({why}): moved to {target}; "
                     f"resuming from step {point.step}")
    if not point.verified:
        lines.append(f"checkpoint {directory / str(point.step)} has no integrity manifest (saved before moejax wrote "
                     "them): restoring it unverified")
    return lines
