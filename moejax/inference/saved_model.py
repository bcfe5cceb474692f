"""What a path given for inference names, and the config inference runs it with, found by reading small files only
(no orbax, no device: jax has not started, so the emulated CPU device count can still follow the config's mesh).

A path is one of:
- a run's WORKDIR (WORKDIR/checkpoints/): its newest checkpoint that passes its integrity check (as a resume picks
  it: moejax/training/checkpoint_integrity.py); the newer ones passed over are named in `warnings`;
- one checkpoint of a run, WORKDIR/checkpoints/STEP (orbax items state/, meta/, config/), refused if it fails the
  check;
- a moejax weights directory (config.json + weights/: `moejax-convert import` writes one);
- a Hugging Face directory (config.json + *.safetensors; deepseek_v3, mixtral or qwen3_moe).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ml_collections

from moejax.config import MESH_AXES
from moejax.config.fields import set_field
from moejax.errors import InputError
from moejax.interop.hf_checkpoint import read_hf_config, without_absent_mtp
from moejax.interop.hf_config import from_hf_config
from moejax.interop.safetensors_io import SafetensorsDir
from moejax.interop.weights_dir import WEIGHTS, is_training_checkpoint, read_config
from moejax.program.weights import weights_mismatch
from moejax.training.checkpoint_integrity import verify

KINDS = ("checkpoint", "weights", "hf")


class ModelPathError(InputError):
    """The path given for inference names no saved model: missing, or not a run, checkpoint, weights or HF dir."""


@dataclass(frozen=True)
class SavedModel:
    kind: str  # one of KINDS
    directory: Path  # the checkpoint's step directory, the weights directory or the HF directory
    saved_cfg: ml_collections.ConfigDict  # the config the model was saved with (an HF directory's: translated)
    step: int | None = None  # a checkpoint's training step
    workdir: Path | None = None  # a checkpoint's run, when the path named the run itself
    warnings: tuple[str, ...] = ()  # for stderr when it is loaded: newer checkpoints passed over, or no manifest

    @property
    def source(self) -> str:
        """What was loaded, as printed: 'checkpoint 250 of runs/tiny', 'weights directory W', ..."""
        if self.kind == "checkpoint":
            return f"checkpoint {self.step} of {self.directory.parent.parent}"
        return f"{'weights' if self.kind == 'weights' else 'Hugging Face'} directory {self.directory}"


def checkpoint_steps(workdir: Path) -> list[int]:
    """The steps of WORKDIR's checkpoints, oldest first, whether or not they pass their integrity check. orbax writes
    a step under a temporary name and renames it to the bare step number when every item of every process is
    written."""
    directory = Path(workdir) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def checkpoint_of(directory: Path, workdir: Path | None = None, warnings: tuple[str, ...] = ()) -> SavedModel:
    return SavedModel("checkpoint", directory, read_config(directory), int(directory.name), workdir, warnings)


def _verified_checkpoint(directory: Path) -> SavedModel:
    verdict = verify(directory)
    if not verdict.ok:
        raise ModelPathError(f"checkpoint {directory} is incomplete or corrupt ({verdict.problem})")
    return checkpoint_of(directory, warnings=() if verdict.verified else (_unverified(directory),))


def _newest_passing(workdir: Path) -> SavedModel:
    """WORKDIR's newest checkpoint that passes its integrity check, with a warning for each newer one that fails."""
    directory, failed = workdir / "checkpoints", []
    for step in reversed(checkpoint_steps(workdir)):
        verdict = verify(directory / str(step))
        if verdict.ok:
            warnings = tuple(f"checkpoint {directory / str(s)} is incomplete or corrupt ({why}); loading step {step}"
                             for s, why in failed) + (() if verdict.verified else (_unverified(directory / str(step)),))
            return checkpoint_of(directory / str(step), workdir=workdir, warnings=warnings)
        failed.append((step, verdict.problem))
    if not failed:
        raise ModelPathError(f"{workdir} holds no complete checkpoint in {directory}")
    raise ModelPathError(f"no checkpoint in {directory} passes its integrity check: "
                         + "; ".join(f"{s} ({why})" for s, why in failed))


def _unverified(step_dir: Path) -> str:
    return f"checkpoint {step_dir} has no integrity manifest (saved before moejax wrote them): loading it unverified"


def find_saved_model(path) -> SavedModel:
    """The saved model `path` names; ModelPathError (one line) when it names none."""
    path = Path(path)
    if not path.exists():
        raise ModelPathError(f"{path} does not exist")
    if is_training_checkpoint(path):
        if not path.name.isdigit():
            raise ModelPathError(f"{path} looks like a checkpoint but is not named by its step (WORKDIR/checkpoints/STEP)")
        return _verified_checkpoint(path)
    if (path / "checkpoints").is_dir():
        return _newest_passing(path)
    if (path / "config.json").is_file() and (path / WEIGHTS).is_dir():
        return SavedModel("weights", path, read_config(path))
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        cfg = without_absent_mtp(from_hf_config(read_hf_config(path)), SafetensorsDir(path).names())
        return SavedModel("hf", path, cfg)
    raise ModelPathError(f"{path} is not a training run (WORKDIR with checkpoints/), a checkpoint "
                         "(WORKDIR/checkpoints/STEP), a weights directory (config.json + weights/) or a Hugging Face "
                         "directory (config.json + *.safetensors)")


def inference_config(saved: SavedModel, overrides=None) -> ml_collections.ConfigDict:
    """The saved config as inference runs it, locked: no pipeline (mesh.stage and mesh.virtual_stages 1, the stages'
    devices given to the data axis unless an axis takes whatever is left) and no gradient accumulation, then
    `overrides` ({"mesh.expert": 4, "train.global_batch": 8, ...}) applied as moejax.load_config applies them. An
    override of a model field the weights fix (the table of moejax.config.changes, as for checkpoint.init_from)
    raises InputError."""
    cfg = ml_collections.ConfigDict(saved.saved_cfg.to_dict())
    mesh = cfg.mesh
    stages = int(mesh.get("stage", 1))
    if stages > 1 and all(int(mesh[a]) != -1 for a in MESH_AXES):  # (validate refuses stage=-1)
        mesh.data = int(mesh.data) * stages
    mesh.stage, mesh.virtual_stages, mesh.pipeline_in_flight = 1, 1, 0
    cfg.train.micro_batches = 1
    # An HF directory's config keeps the default run length of moejax's configs, which may pass its positions.
    cfg.train.seq_len = min(int(cfg.train.seq_len), int(cfg.model.max_seq_len))
    cfg.lock()
    for key, value in (overrides or {}).items():
        set_field(cfg, key, value)
    mismatch = weights_mismatch(saved.saved_cfg, cfg)
    if mismatch:
        raise InputError(f"the override {mismatch[0].split(' ')[0]} changes the model the weights of {saved.source} "
                         f"were saved for ({mismatch[0]})")
    return cfg
