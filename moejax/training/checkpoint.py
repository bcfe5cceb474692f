"""orbax checkpoints under WORKDIR/checkpoints: what a run needs to continue exactly, saved asynchronously.

A checkpoint at step s has three items:
- `state`: the TrainState (parameters, Adam moments and count, router bias, step), sharded; restored onto
  whatever mesh the resuming run has (orbax reshards on restore);
- `meta`: the step, the seed, the data iterator's state (the next batch index) with a fingerprint of the
  data it indexes, and the guard counters (skipped steps);
- `config`: the resolved config, so a resume can refuse a config whose state or data order differs.
The run has no stateful RNG to save: initialisation is a function of `seed`, the data order of
(`seed`, step), and nothing in the step draws random numbers.

orbax writes a step into a temporary directory and renames it when every item and every process is done,
so an interrupted save is never listed and a resume never picks it. Just before that rename, process 0 writes
the step's integrity manifest (every file's size and CRC32: checkpoint_integrity.py); which step a resume
restores is resume_point.py's choice. Retention: the latest `keep`, plus every step that is a multiple of
`keep_every_steps` (never deleted).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from moejax.errors import InputError
from moejax.training.checkpoint_integrity import step_being_saved, write_manifest

ITEMS = ("state", "meta", "config")


class CheckpointError(InputError, RuntimeError):
    """WORKDIR's checkpoints cannot be resumed by this run; the message says why and what to do."""


def orbax_manager(directory: Path, ckpt_cfg=None, *, read_only: bool = False,
                  on_finalized=None) -> ocp.CheckpointManager:
    """orbax's manager of DIR's steps; on_finalized: called on process 0 once a save's files are all written, before
    orbax commits the step (checkpoint_integrity.py writes the manifest then)."""
    if read_only:
        options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    else:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max(1, int(ckpt_cfg.keep)), keep_period=int(ckpt_cfg.keep_every_steps) or None,
            create=True, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=on_finalized))
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=ITEMS)


def error_summary(error: Exception) -> str:
    """An exception's first line, cut to 200 characters (orbax's errors run to pages)."""
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__


def _unreadable(directory: Path, step: int, steps, error: Exception) -> str:
    older = [s for s in steps if s < step]
    return (f"checkpoint {directory / str(step)} is incomplete or corrupt ({error_summary(error)}); move it out of "
            f"{directory} to resume from " + (f"step {max(older)}" if older else "scratch"))


@contextlib.contextmanager
def stderr_held_while_restoring():
    """When one array cannot be read, orbax gives up while other reads are in flight, and their callbacks print
    tracebacks into its closed event loop from tensorstore threads. What is printed meanwhile is held: replayed on
    success; on failure stderr stays held, as the process is about to exit 2 with one clear line."""
    captured, real_stderr = io.StringIO(), sys.stderr
    sys.stderr = captured
    yield
    sys.stderr = real_stderr
    real_stderr.write(captured.getvalue())


class Checkpointer:
    def __init__(self, directory: Path, ckpt_cfg):
        self.directory = Path(directory)
        self._manager = orbax_manager(self.directory, ckpt_cfg, on_finalized=self._write_manifest)
        self._saving = None  # the step of the save in flight

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, *, meta: dict, config_json: str):
        """Starts an asynchronous save (returns once the device arrays are copied to host memory)."""
        # orbax waits for the previous save before it starts this one; waiting here first keeps that save's
        # manifest callback from reading this step
        self._manager.wait_until_finished()
        self._saving = step
        self._manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
            config=ocp.args.JsonSave(json.loads(config_json))))

    def _write_manifest(self):
        write_manifest(step_being_saved(self.directory.absolute(), self._saving), ITEMS)

    def saved_config(self, step: int) -> dict:
        """The resolved config the run that saved `step` had."""
        try:
            return dict(self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config)
        except Exception as e:
            raise CheckpointError(_unreadable(self.directory, step, self._manager.all_steps(), e)) from None

    def restore(self, step: int, abstract_state, shardings) -> tuple[object, dict]:
        """(state on the given shardings, which may belong to another mesh than the save's; meta)."""
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract_state, shardings)
        with stderr_held_while_restoring():
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
            except Exception as e:
                raise CheckpointError(_unreadable(self.directory, step, self._manager.all_steps(), e)) from None
        return restored.state, dict(restored.meta)

    def wait(self):
        self._manager.wait_until_finished()

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()
