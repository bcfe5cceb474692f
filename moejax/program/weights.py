"""Step 0 of a run that starts from saved weights (`checkpoint.init_from`): a weights directory (written by
`moejax-convert import`) or another run's training checkpoint (WORKDIR/checkpoints/STEP, e.g. pre-training
continued by context extension). Parameters and router bias are restored straight onto the mesh; the
optimizer starts afresh."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from moejax.config.changes import Continuation, changed_fields
from moejax.errors import InputError
from moejax.interop.safetensors_io import CheckpointFormatError
from moejax.interop.weights_dir import is_training_checkpoint, load_weights, read_config
from moejax.program.optim import init_optimizer_state
from moejax.program.state import TrainState, abstract_state, train_state_shardings


class WeightsMismatchError(InputError):
    """The weights directory was saved for a model this config does not build."""


def weights_mismatch(saved_cfg, cfg) -> list[str]:
    """The fields in which a weights directory's config and the run's config differ where they may not
    (moejax.config.changes, INIT_FROM)."""
    return [f"{field} is {saved!r} in the weights, {now!r} in the config"
            for field, saved, now in changed_fields(saved_cfg.to_dict(), cfg.to_dict(), Continuation.INIT_FROM)]


def init_state_from_weights(cfg, tx, mesh: Mesh, directory) -> tuple[TrainState, object]:
    """(state sharded on mesh, its shardings); orbax reshards the saved arrays onto this mesh."""
    try:
        saved_cfg = read_config(directory)
        mismatch = weights_mismatch(saved_cfg, cfg)
        if mismatch:
            raise WeightsMismatchError(f"checkpoint.init_from={directory}: {mismatch[0]}"
                                       + (f" (and {len(mismatch) - 1} more)" if len(mismatch) > 1 else ""))
        abstract = abstract_state(cfg, tx)
        shardings = train_state_shardings(cfg, abstract, mesh)
        if is_training_checkpoint(directory):
            # The saved item's structure: its optimizer state holds f32 masters or not (optim.master_weights).
            like = cfg.copy_and_resolve_references()
            with like.unlocked():
                like.optim.master_weights = bool(saved_cfg.get("optim", {}).get("master_weights", False))
            saved_abstract = abstract_state(like, tx)
            params, model_state = _restore_weights_of_checkpoint(
                directory, saved_abstract, train_state_shardings(like, saved_abstract, mesh))
        else:
            params, model_state = load_weights(directory, abstract.params, abstract.model_state,
                                               (shardings.params, shardings.model_state))
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"checkpoint.init_from: {e}") from None
    with jax.set_mesh(mesh):
        opt_state = jax.jit(functools.partial(init_optimizer_state, cfg.optim, tx),
                            out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(step=step, params=params, model_state=model_state, opt_state=opt_state), shardings


def _restore_weights_of_checkpoint(directory, abstract: TrainState, shardings) -> tuple:
    """(params, model_state) of a training checkpoint's `state` item. The item is restored whole (its optimizer
    moments too, sharded like the parameters, then dropped): orbax restores a saved pytree against a target of
    the same structure."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            restored = checkpointer.restore(Path(directory).absolute() / "state", target)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointFormatError(f"{directory}: the checkpoint does not match the model "
                                        f"({str(e).strip().splitlines()[0][:200]})") from None
    return restored.params, restored.model_state
