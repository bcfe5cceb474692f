"""A saved model loaded for inference: its parameters and router bias restored straight onto a mesh (orbax and the
HF reader place each device's slice; nothing is gathered on one device), never the optimizer moments.

    loaded = load_model("runs/tiny")                      # or WORKDIR/checkpoints/STEP, a weights or an HF directory
    loaded.model(tokens_BxL).logits_BxLxV                  # under jax.set_mesh(loaded.mesh)

Inference never pipelines (saved_model.inference_config): a checkpoint saved with pipeline stages whose MoE stack
is stored in chunk slots is moved into the plain layer order (program/state.py's restack).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from moejax.config import MESH_AXES, ConfigError, validate
from moejax.errors import InputError
from moejax.inference.saved_model import SavedModel, find_saved_model, inference_config
from moejax.interop.hf_checkpoint import load_hf_state
from moejax.interop.safetensors_io import CheckpointFormatError
from moejax.interop.weights_dir import load_weights
from moejax.kernels.resolve import KERNEL_FIELDS, apply_kernels, devices_compute_capability, devices_platform
from moejax.model.transformer import Transformer
from moejax.parallel.cpu_devices import has_device_count_flag, mesh_device_count, request_cpu_devices
from moejax.parallel.mesh import mesh_from_config
from moejax.program.state import create_model, restack, restore_shardings, stacked_like, state_shardings
from moejax.training import distributed
from moejax.training.checkpoint import stderr_held_while_restoring


@dataclass(frozen=True)
class LoadedModel:
    model: Transformer  # parameters and router bias sharded on `mesh`
    cfg: ml_collections.ConfigDict  # the config the model was built with (inference_config's), locked
    mesh: Mesh
    source: str  # "checkpoint STEP of WORKDIR", "weights directory DIR", "Hugging Face directory DIR"
    step: int | None  # a checkpoint's training step


def load_model(path, *, overrides: dict | None = None, mesh: Mesh | None = None) -> LoadedModel:
    """The model `path` names (a run's WORKDIR, WORKDIR/checkpoints/STEP, a weights directory or an HF directory;
    saved_model.py), on `mesh` (default: the config's mesh axes over all of jax.devices()). overrides: config
    fields, as for moejax.load_config. Raises InputError (one line) for a path that names no model, an override
    the weights do not allow, a mesh the config does not fit, or a checkpoint that fails its integrity check or does
    not restore."""
    saved = path if isinstance(path, SavedModel) else find_saved_model(path)
    cfg = inference_config(saved, overrides)
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()
    _apply_kernels_here(cfg, devices)
    if mesh is not None:
        if tuple(mesh.axis_names) != MESH_AXES or mesh.shape["stage"] > 1:
            raise InputError(f"load_model needs a mesh of the axes {MESH_AXES} with stage 1 (inference never "
                             f"pipelines), not {dict(mesh.shape)}")
        for axis, size in mesh.shape.items():
            cfg.mesh[axis] = int(size)
    sizes = validate(cfg, len(devices))
    mesh = mesh if mesh is not None else mesh_from_config(cfg, sizes)
    model = _restored_model(saved, cfg, mesh)
    # newer checkpoints passed over, or no manifest; said once it loaded: a failure is one line of its own
    for line in saved.warnings if jax.process_index() == 0 else ():
        print(f"warning: {line}", file=sys.stderr, flush=True)
    return LoadedModel(model, cfg, mesh, saved.source, saved.step)


def load_for_inference(path, overrides: dict | None = None, *, coordinator: str | None = None,
                       num_processes: int | None = None, process_id: int | None = None,
                       init_timeout: int = 300) -> LoadedModel:
    """load_model as the entry points call it, like moejax.api.prepare_training: the config is read before jax starts
    (small files only), so that without an accelerator its mesh is emulated in CPU devices; then the job is joined
    (the flags or variables of training/distributed.py) and the processes' configs compared. `path` may also be the
    SavedModel find_saved_model found. Raises InputError, DistributedError."""
    from jax._src import xla_bridge  # backends_are_initialized: no public equivalent

    saved = path if isinstance(path, SavedModel) else find_saved_model(path)
    cfg = inference_config(saved, overrides)
    if not xla_bridge.backends_are_initialized() and not has_device_count_flag():
        request_cpu_devices(mesh_device_count(cfg.mesh))
    distributed.initialize(coordinator, num_processes, process_id, init_timeout)
    distributed.check_processes_agree(cfg.to_json_best_effort(sort_keys=True), init_timeout)
    return load_model(saved, overrides=overrides)


def _apply_kernels_here(cfg, devices):
    """cfg.kernels resolved for these devices' platform. A saved config names the kernels its run resolved; where
    one cannot run here (a GPU run's tokamax kernels on a CPU), every kernel goes back to `auto`."""
    platform, capability = devices_platform(devices), devices_compute_capability(devices)
    try:
        apply_kernels(cfg, platform, capability)
    except ConfigError:
        for field in KERNEL_FIELDS:
            cfg.kernels[field] = "auto"
        cfg.moe.exchange_chunks = 0
        apply_kernels(cfg, platform, capability)


def _restored_model(saved: SavedModel, cfg, mesh: Mesh) -> Transformer:
    if saved.kind == "hf":
        abstract = nnx.eval_shape(lambda: create_model(cfg, 0))
        graphdef, params, model_state = load_hf_state(saved.directory, cfg, abstract,
                                                      state_shardings(nnx.state(abstract), mesh))
        return nnx.merge(graphdef, params, model_state)
    graphdef, target = _abstract_weights(cfg)
    saved_like = stacked_like(saved.saved_cfg.to_dict(), cfg)  # None: the MoE stack is stored as this model's
    if saved_like is None:
        weights = _read_weights(saved, target, state_shardings(target, mesh))
    else:
        _, as_saved = _abstract_weights(saved_like)
        weights = _read_weights(saved, as_saved, restore_shardings(saved_like, as_saved, mesh))
        weights = restack(weights, target, state_shardings(target, mesh), mesh, saved_like, cfg)
    return nnx.merge(graphdef, weights["params"], weights["model_state"])


def _abstract_weights(cfg) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, {"params", "model_state"} of abstract Variables): a model's weights, nothing allocated."""
    graphdef, params, model_state = nnx.split(nnx.eval_shape(lambda: create_model(cfg, 0)), nnx.Param, ...)
    return graphdef, {"params": params, "model_state": model_state}


def _read_weights(saved: SavedModel, abstract: dict, shardings: dict) -> dict:
    """{"params", "model_state"} restored onto `shardings` from a training checkpoint or a weights directory."""
    if saved.kind == "weights":
        params, model_state = load_weights(saved.directory, abstract["params"], abstract["model_state"],
                                           (shardings["params"], shardings["model_state"]))
        return {"params": params, "model_state": model_state}
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    # Only the items named in the target are read: the optimizer moments (twice the parameters) stay on disk.
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=True)
    with ocp.PyTreeCheckpointer() as checkpointer, stderr_held_while_restoring():
        try:
            return checkpointer.restore(Path(saved.directory).absolute() / "state", args=args)
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types; all mean "cannot read it"
            what = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise CheckpointFormatError(f"{saved.source} does not restore ({what})") from None
