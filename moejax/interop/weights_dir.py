"""A moejax weights directory: model parameters and router state (orbax) plus the resolved config.

What `moejax-convert import` writes and `moejax-convert export` reads, and what a run can start from
(`checkpoint.init_from`). Layout: DIR/config.json (the moejax config) and DIR/weights/ (orbax; the nnx
States as pure dicts {"params": ..., "model_state": ...}). The weights are written to DIR/weights.partial
and renamed when complete, so an interrupted import never looks usable.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from moejax.interop.safetensors_io import CheckpointFormatError

WEIGHTS = "weights"


def save_weights(directory, cfg, params: nnx.State, model_state: nnx.State):
    directory = Path(directory).absolute()
    if (directory / WEIGHTS).exists():
        raise FileExistsError(f"{directory / WEIGHTS} exists; write into a new directory")
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"{WEIGHTS}.partial"
    if partial.exists():
        shutil.rmtree(partial)  # a previous interrupted import
    tree = {"params": nnx.to_pure_dict(params), "model_state": nnx.to_pure_dict(model_state)}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(partial, tree)
        ckptr.wait_until_finished()
    (directory / "config.json").write_text(cfg.to_json(indent=2, sort_keys=True))
    (directory / "train_config.py").write_text(TRAIN_CONFIG)
    partial.rename(directory / WEIGHTS)


# Written next to the weights so that `moejax-train --config DIR/train_config.py` continues from them.
TRAIN_CONFIG = '''"""Continue training from the weights in this directory (written by moejax-convert import).
Override any field on the command line, e.g. --config.mesh.expert=8 --config.train.steps=1000."""

import json
from pathlib import Path

import ml_collections


def get_config():
    here = Path(__file__).resolve().parent
    c = ml_collections.ConfigDict(json.loads((here / "config.json").read_text()))
    c.checkpoint.init_from = str(here)
    return c
'''


def is_training_checkpoint(directory) -> bool:
    """A step of a training run's checkpoints (WORKDIR/checkpoints/STEP: orbax items state/, meta/, config/)."""
    return (Path(directory) / "state").is_dir() and (Path(directory) / "config" / "metadata").is_file()


def check_weights_dir(directory):
    """checkpoint.init_from names a weights directory or a training checkpoint (validation before compile)."""
    if not (Path(directory) / WEIGHTS).is_dir() and not is_training_checkpoint(directory):
        raise CheckpointFormatError(f"checkpoint.init_from={str(directory)!r} is neither a weights directory "
                                    "(moejax-convert import writes one: config.json + weights/) nor a training "
                                    "checkpoint (WORKDIR/checkpoints/STEP)")


def read_config(directory) -> ml_collections.ConfigDict:
    """The config the weights were saved with: config.json of a weights directory, or the `config` item of a
    training checkpoint (orbax's JSON item is the file config/metadata)."""
    if is_training_checkpoint(directory):
        return ml_collections.ConfigDict(json.loads((Path(directory) / "config" / "metadata").read_text()))
    path = Path(directory) / "config.json"
    if not path.is_file() or not (Path(directory) / WEIGHTS).is_dir():
        raise CheckpointFormatError(f"{directory}: not a moejax weights directory (needs config.json and {WEIGHTS}/)")
    return ml_collections.ConfigDict(json.loads(path.read_text()))


def load_weights(directory, abstract_params: nnx.State, abstract_model_state: nnx.State, shardings=None):
    """(params, model_state) restored onto `shardings` (nnx States of shardings; default: first device).
    The saved arrays may come from any mesh: orbax reshards on restore."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def target(abstract_state, sharding_state):
        pure = nnx.to_pure_dict(abstract_state)
        shard = nnx.to_pure_dict(sharding_state) if sharding_state is not None else jax.tree.map(lambda _: default, pure)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), pure, shard)

    p_shard, s_shard = shardings if shardings is not None else (None, None)
    tree = {"params": target(abstract_params, p_shard), "model_state": target(abstract_model_state, s_shard)}
    with ocp.StandardCheckpointer() as ckptr:
        try:
            restored = ckptr.restore(Path(directory).absolute() / WEIGHTS, tree)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointFormatError(f"{directory}: weights do not match the model ({str(e).splitlines()[0]})") from None
    params, model_state = abstract_params, abstract_model_state
    nnx.replace_by_pure_dict(params, restored["params"])
    nnx.replace_by_pure_dict(model_state, restored["model_state"])
    return params, model_state
