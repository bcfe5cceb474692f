"""orbax checkpoints of the TrainState under WORKDIR/checkpoints: async saves, keep the latest K, resume.

Data needs no iterator state: the pipeline is random access, so batch i is a function of (seed, i) and the
step number alone says where to resume reading.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: Path, *, keep: int, every_steps: int):
        self.every_steps = every_steps
        options = ocp.CheckpointManagerOptions(max_to_keep=max(1, keep), create=True,
                                               enable_async_checkpointing=True)
        self._manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.every_steps > 0 and step % self.every_steps == 0)

    def save(self, step: int, state):
        self._manager.save(step, args=ocp.args.StandardSave(state))

    def restore(self, step: int, abstract_state, shardings):
        """Restore onto the given shardings (which may belong to a different mesh than the save's)."""
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract_state, shardings)
        return self._manager.restore(step, args=ocp.args.StandardRestore(target))

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()
