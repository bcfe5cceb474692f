"""Devices -> Mesh, and the ONE table that maps the model's logical axis names onto mesh axes.

The model only speaks logical names ('embed', 'expert', 'batch', ...). This module is the only place that
knows which mesh axis each one lands on. Every logical name must appear here: an unknown name is an error,
never a silent replication.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from moejax.config import MESH_AXES
from moejax.parallel.device_grid import hybrid_device_grid
from moejax.parallel.topology import detect_topology, device_domains, get_topology

# Tokens are split over every axis that is not model-parallel: experts see all of them through all-to-all.
# Inside a pipeline stage these (the stage's own devices); outside the stages also over `stage` (batch_axes()).
BATCH_AXES = ("data", "fsdp", "expert")
STAGE_AXIS = "stage"
EXPERT_AXIS = "expert"
CONTEXT_AXIS = "context"  # a sequence's positions (logical "seq"): parallel/context.py
FSDP_AXIS = "fsdp"  # parameters' d_model ("embed") split (LOGICAL_RULES["embed"])
FFN_AXIS = "tensor"  # expert FFN slices inside the dispatch shard_map (LOGICAL_RULES["expert_mlp"])

_INSIDE_STAGE = contextvars.ContextVar("moejax_inside_stage", default=False)


@contextlib.contextmanager
def inside_stage():
    """Code traced in this block runs inside a pipeline stage (the stage function, under the pipeline's vmap over
    `stage`, or what every stage computes alike): its token rows are split over BATCH_AXES only."""
    token = _INSIDE_STAGE.set(True)
    try:
        yield
    finally:
        _INSIDE_STAGE.reset(token)


def batch_axes() -> tuple[str, ...]:
    """The mesh axes token rows are split over where this is traced. Outside pipeline stages `stage` too: the
    embedding, the dense layers, the LM head and the loss run data-parallel over the stages (each computes 1/S of
    the rows, none the whole batch); the rows are gathered over `stage` where the pipeline starts. Without stages
    the axis has size 1 and changes nothing."""
    return BATCH_AXES if _INSIDE_STAGE.get() else (*BATCH_AXES, STAGE_AXIS)


def row_shards(mesh=None) -> int:
    """Devices a batch's rows are split over (batch_axes()) on `mesh`, default the current one; 1 without a mesh."""
    mesh = current_mesh() if mesh is None else mesh
    return 1 if mesh is None else int(np.prod([mesh.shape[a] for a in batch_axes()]))


def token_axes() -> tuple[str, ...]:
    """The mesh axes a [B * L] row of flattened tokens is split over: batch_axes() for the rows, then `context` for
    each row's positions (major to minor, as a [B, L] array split (batch_axes(), context) flattens)."""
    return (*batch_axes(), CONTEXT_AXIS)


def inside_pipeline_stage(mesh) -> bool:
    """Traced inside the pipeline's stages (mesh.stage > 1 and inside_stage()): under its vmap over `stage`."""
    return mesh.shape.get(STAGE_AXIS, 1) > 1 and STAGE_AXIS not in batch_axes()


LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": BATCH_AXES,  # resolved by batch_axes() where it is used (logical_to_spec)
    "seq": CONTEXT_AXIS,  # context parallelism: each device holds a front and a back piece (parallel/context.py)
    "act_embed": None,
    "token_rows": BATCH_AXES + (CONTEXT_AXIS,),  # rows of flattened positions: token_axes() where it is used
    # parameters
    "vocab": "tensor",
    "embed": FSDP_AXIS,
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "q_lora": None,  # MLA's low-rank bottlenecks are small (1536, 512): replicated over tensor
    "kv_lora": None,
    "mtp_concat": None,  # the MTP projection's [embedding; hidden] input dim
    "expert": EXPERT_AXIS,
    "expert_mlp": FFN_AXIS,
    "router_expert": None,  # the router's expert dim stays whole: every token scores every expert
    "layers": None,  # the scanned layer dim
    "stage_layers": "stage",  # the pipelined MoE stack's layer dim: each stage holds its chunks
    "repeat": None,  # virtual stages: the pipelined stack's leading [V] dim
    "norm": None,
}


def make_mesh(sizes: dict[str, int], devices=None, *, topology: str = "auto", domain_size: int = 0,
              allow_cross_domain: bool = False) -> Mesh:
    """A mesh with axes MESH_AXES in that order, Auto axis types (shard_map and GSPMD both work on it).

    Devices are placed by NVLink domain (`device.slice_index`, or the topology's domain size over
    (process_index, id) order, or `domain_size` when given): `expert` x `tensor` groups inside one domain,
    `data`/`fsdp` across (parallel/device_grid.py). An expert group that would span two domains raises
    MeshLayoutError unless allow_cross_domain. One process's devices on CPU form one domain, so a plain
    call lays the devices out in order.
    """
    devices = list(jax.devices() if devices is None else np.asarray(devices).reshape(-1))
    topo = (detect_topology(devices[0].device_kind, devices[0].platform) if topology == "auto"
            else get_topology(topology))
    domains = device_domains(devices, topo, domain_size)
    where = f", {topo.name}" if topo.name != "cpu" else ""
    device_grid = hybrid_device_grid(sizes, devices, domains, allow_cross_domain=allow_cross_domain, where=where)
    return Mesh(device_grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_from_config(cfg, sizes: dict[str, int], devices=None) -> Mesh:
    """make_mesh with the config's topology settings (mesh.topology, mesh.domain_size,
    mesh.allow_cross_domain_experts)."""
    m = cfg.mesh
    return make_mesh(sizes, devices, topology=m.get("topology", "auto"), domain_size=int(m.get("domain_size", 0)),
                     allow_cross_domain=bool(m.get("allow_cross_domain_experts", False)))


def logical_to_spec(names) -> P:
    """PartitionSpec for a tuple of logical axis names (None entries stay unsharded)."""
    out = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no rule in moejax.parallel.mesh.LOGICAL_RULES")
        out.append(batch_axes() if name == "batch" else token_axes() if name == "token_rows" else LOGICAL_RULES[name])
    return P(*out)


def current_mesh():
    """The mesh set by `jax.set_mesh`, or None on a single device / no mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return None
    return mesh


def mesh_platform(mesh) -> str | None:
    """'gpu', 'cpu', ... of the abstract mesh's devices; None for a mesh that names none."""
    device = getattr(mesh, "abstract_device", None)
    return None if device is None else ("gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform)


def constrain(x, names):
    """Sharding constraint by logical names; a no-op when no mesh is set (single-device reference)."""
    if current_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names))


def map_over_batch(fn, *arrays_BxLxN):
    """fn applied to each device's rows and positions ([B, L, ...] split like activations) inside shard_map; plain
    call without a mesh.

    For per-token ops GSPMD cannot partition: XLA replicates lax.top_k (all-gathering its input) rather
    than splitting it over the batch.
    """
    mesh = current_mesh()
    if mesh is None:
        return fn(*arrays_BxLxN)
    spec = P(batch_axes(), CONTEXT_AXIS)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arrays_BxLxN), out_specs=spec)(*arrays_BxLxN)


def map_over_batch_heads(fn, q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL=None):
    """fn(q, k, v, segment_ids) on each device's batch rows and heads (split over `tensor` when both head
    counts divide by it), inside shard_map; a plain call without a mesh. For attention kernels that are custom
    calls, which GSPMD would otherwise run replicated (all-gathering q, k and v)."""
    mesh = current_mesh()
    if mesh is None:
        return fn(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL)
    tensor = mesh.shape["tensor"]
    heads = "tensor" if q_BxLxHxK.shape[2] % tensor == 0 and k_BxLxGxK.shape[2] % tensor == 0 else None
    rows = batch_axes()
    qkv = P(rows, None, heads, None)
    if segment_ids_BxL is None:
        return jax.shard_map(lambda q, k, v: fn(q, k, v, None), mesh=mesh, in_specs=(qkv,) * 3, out_specs=qkv,
                             check_vma=False)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV)
    return jax.shard_map(fn, mesh=mesh, in_specs=(qkv,) * 3 + (P(rows, None),), out_specs=qkv,
                         check_vma=False)(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL)


def named_sharding(mesh: Mesh, names) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [batch, seq] token array as the data pipeline delivers it: rows split, each row whole (its L + 1
    tokens do not split over `context`; the model puts the positions in context order itself, a few bytes a token)."""
    return named_sharding(mesh, ("batch", None))
