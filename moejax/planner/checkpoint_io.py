"""Checkpoint size and save time of a layout, predicted from the train state's leaves (state_shapes.py): what orbax
writes to the shared checkpoint directory, and what a two-tier checkpoint's local tier writes to each node's disk.

Which device writes which bytes follows orbax 0.12 (orbax/checkpoint/_src/serialization/replica_slices.py): a shard
held by R devices (a leaf replicated over some mesh axes) is written once. With replica-parallel saving (orbax's
default unless JAX_PLATFORMS names gpu or cuda; moejax's launchers leave it unset) each of the R holders writes 1/R
of it, cut along the first dim of the shard that R divides; without it, or where no dim divides, the first holder in
mesh order (jax's replica 0) writes it all, so the nodes holding mesh coordinate 0 of the replicated axes write more.
Devices sit on the mesh as parallel/device_grid.py places them; a node is `gpus_per_node` consecutive devices in
(process, id) order, as the launchers number them.

The local tier: every process writes each distinct shard its devices hold (deduplicated within the process, not
across processes: a replicated leaf is written by every process) and keeps a copy of another node's, which a device
collective sends over the network.

Sizes are array bytes: orbax's zstd compression of each chunk is not counted (an upper bound; float weights and
moments compress little), nor are metadata files. Times are bytes over bandwidth: no latency, no contention with the
step's own traffic, and the step waits for neither (saves are asynchronous after the device-to-host copy).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from moejax.config import MESH_AXES
from moejax.parallel.device_grid import MeshLayoutError, hybrid_device_grid
from moejax.planner.layout import Layout, layout_config
from moejax.planner.state_shapes import Leaf, state_leaves
from moejax.program.state import optimizer_state_axes

GB = 1e9

# Default bandwidths, GB/s (1e9 bytes/s); assumptions to replace with the cluster's own numbers:
PERSISTENT_GBPS = 100.0  # the shared file system's aggregate write rate (Lustre, GPFS, VAST, WEKA: tens to hundreds
#                          of GB/s with its size; 100 is a mid-sized all-flash system, not a measurement)
NODE_PERSISTENT_GBPS = 50.0  # one node to the file system: a 400 Gb/s storage NIC per GB300 tray (assumed)
LOCAL_WRITE_GBPS = 20.0  # a GB300 tray's local cache: 4 E1.S NVMe drives in RAID 0 (NVIDIA's GB300 NVL72 reference
#                          architecture, DGX GB200 user guide) at an assumed 5 GB/s sequential write each
PEER_LINK_GBPS = 400.0  # a GB300 tray's 4 ConnectX-8 at 800 Gb/s (parallel/topology.py: 100 GB/s per GPU); a peer
#                         inside the same NVL72 rack could be reached over NVLink instead (900 GB/s per GPU)


@dataclass(frozen=True)
class _Device:  # what device_grid reads of a device
    id: int
    process_index: int


@dataclass(frozen=True)
class CheckpointCost:
    nodes: int
    total_bytes: int  # the whole TrainState, each array once: what the persistent directory holds
    persistent_node_bytes: int  # the most one node writes to the persistent directory
    persistent_node_bytes_min: int  # the least (replica 0's nodes write more without replica-parallel saving)
    persistent_save_s: float  # the slower of the file system's aggregate rate and the busiest node's link
    local_own_bytes: int  # the most one node's processes hold: written to its disk, and sent to its peer
    local_disk_bytes: int  # on one node's disk: its own shards and its peer's copy
    peer_send_s: float  # the peer copy over the node's link
    local_write_s: float  # own + peer copy at the local disk's rate
    assumptions: dict

    def to_dict(self) -> dict:
        return asdict(self)


def _mesh_positions(layout: Layout, gpus_per_node: int, gpus_per_process: int, domain_size: int):
    """(node, process) of the device at each mesh position, in the mesh's flat order, and the positions' coordinates
    {axis: [n]}."""
    n = layout.n_devices
    devices = [_Device(i, i // gpus_per_process) for i in range(n)]
    per_domain = domain_size or n
    shape = tuple(layout.sizes[a] for a in MESH_AXES)
    try:
        grid = hybrid_device_grid(layout.sizes, devices, [i // per_domain for i in range(n)], allow_cross_domain=True)
        flat = list(grid.reshape(-1))
    except MeshLayoutError:  # stages that split no domain evenly (moejax would refuse them): devices in order
        flat = devices
    node = np.array([d.id // gpus_per_node for d in flat])
    process = np.array([d.process_index for d in flat])
    coords = dict(zip(MESH_AXES, np.indices(shape).reshape(len(shape), -1)))
    return node, process, coords


def _shards(leaf: Leaf, sizes: dict[str, int], coords) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """(shard index of each mesh position, the bytes of that position's shard, the first shard's shape). A dim split
    over several mesh axes is split major-to-minor as a PartitionSpec's tuple lists them; an uneven split's last
    shard is short (jax's slices)."""
    n = next(iter(coords.values())).size
    index, nbytes, first = np.zeros(n, dtype=np.int64), np.full(n, leaf.itemsize, dtype=np.int64), []
    for dim, length in enumerate(leaf.shape):
        axes = leaf.mesh_axes(dim)
        parts = math.prod(sizes[a] for a in axes)
        position = np.zeros(n, dtype=np.int64)
        for a in axes:
            position = position * sizes[a] + coords[a]
        chunk = -(-length // parts)
        index = index * parts + position
        nbytes *= np.clip(length - position * chunk, 0, chunk)
        first.append(chunk)
    return index, nbytes, tuple(first)


def _replica_rank(index: np.ndarray) -> np.ndarray:
    """Each position's rank among the positions holding the same shard, in mesh order (jax's replica_id)."""
    rank, seen = np.empty_like(index), {}
    for i, key in enumerate(index.tolist()):
        rank[i] = seen.get(key, 0)
        seen[key] = rank[i] + 1
    return rank


def checkpoint_cost(cfg, layout: Layout, *, gpus_per_node: int = 4, gpus_per_process: int = 0,
                    domain_size: int = 0, replica_parallel: bool = True,
                    persistent_gbps: float = PERSISTENT_GBPS, node_persistent_gbps: float = NODE_PERSISTENT_GBPS,
                    local_write_gbps: float = LOCAL_WRITE_GBPS, peer_link_gbps: float = PEER_LINK_GBPS
                    ) -> CheckpointCost:
    """The layout's checkpoint: total size, the bytes each node writes to the persistent directory and the save's
    time, and the local tier's bytes per node and times. gpus_per_node: 4 on a GB300 tray, 8 on an HGX node.
    gpus_per_process: 0 for one process per node (launch/k8s); 1 for one per GPU (launch/slurm). domain_size: devices
    per NVLink domain as the job uses them (0: one domain), which decides where the mesh puts each device.
    replica_parallel: orbax's replica-parallel saving (see the module's docstring)."""
    gpus_per_process = gpus_per_process or gpus_per_node
    if layout.n_devices % gpus_per_node or gpus_per_node % gpus_per_process:
        raise ValueError(f"{layout.n_devices} devices in nodes of {gpus_per_node} and processes of "
                         f"{gpus_per_process}: the node must divide the job and the process the node")
    sizes = layout.sizes
    params, model_state, opt = state_leaves(layout_config(cfg, layout))
    over = optimizer_state_axes(cfg)  # a distributed optimizer's moments are split further, over data
    step = Leaf("step", (), 4, ())  # TrainState.step, an int32 scalar that state_leaves leaves out
    leaves = [*params, *model_state, *(leaf.split_further(sizes, over) for leaf in opt), step]

    node, process, coords = _mesh_positions(layout, gpus_per_node, gpus_per_process, domain_size)
    n_nodes = layout.n_devices // gpus_per_node
    persistent = np.zeros(n_nodes)
    local = np.zeros(n_nodes)
    for leaf in leaves:
        index, nbytes, first = _shards(leaf, sizes, coords)
        replicas = layout.n_devices // len(np.unique(index))
        if replica_parallel and replicas > 1 and any(d % replicas == 0 for d in first) and math.prod(first):
            written = nbytes / replicas  # every holder writes its slice
        else:
            written = np.where(_replica_rank(index) == 0, nbytes, 0)
        persistent += np.bincount(node, weights=written, minlength=n_nodes)
        # The local tier: one copy of each shard per process (process and shard index as one key).
        _, first_of_each = np.unique(process * (index.max() + 1) + index, return_index=True)
        local += np.bincount(node[first_of_each], weights=nbytes[first_of_each], minlength=n_nodes)

    total = sum(math.prod(leaf.shape) * leaf.itemsize for leaf in leaves)
    own = int(local.max())
    # The peer copy is another node's own shards; nodes hold equal shares wherever the mesh repeats itself across
    # them, so the largest node's share is taken for both.
    local_disk = 2 * own
    return CheckpointCost(
        nodes=n_nodes, total_bytes=int(total),
        persistent_node_bytes=int(persistent.max()), persistent_node_bytes_min=int(persistent.min()),
        persistent_save_s=float(max(total / (persistent_gbps * GB), persistent.max() / (node_persistent_gbps * GB))),
        local_own_bytes=own, local_disk_bytes=local_disk,
        peer_send_s=own / (peer_link_gbps * GB), local_write_s=local_disk / (local_write_gbps * GB),
        assumptions={"gpus_per_node": gpus_per_node, "gpus_per_process": gpus_per_process,
                     "domain_size": domain_size or layout.n_devices, "replica_parallel": replica_parallel,
                     "persistent_gbps": persistent_gbps, "node_persistent_gbps": node_persistent_gbps,
                     "local_write_gbps": local_write_gbps, "peer_link_gbps": peer_link_gbps})
