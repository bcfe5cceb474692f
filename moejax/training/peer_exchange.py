"""Moving one process's shards of the train state to another process, over the devices' own links.

The local checkpoint tier keeps, on each node, a copy of another node's shards, so that losing a node loses
nothing. The copy travels as a device collective (NCCL over NVLink/InfiniBand on GPUs, gloo between CPU
processes): per leaf, every device puts its shard (flattened, zero-padded to the largest shard of the leaf) into
one block of a [processes, local devices, max shard] array laid out one process per row, and a `ppermute` over
the process axis sends row h to row q for each (h, q) of the permutation. Local device j of one process sends
to local device j of the other, so the receiver knows which device's shard it got from the global sharding.

One leaf at a time: the extra device memory is two blocks of the largest leaf's shard, not a copy of the state.
Every process of the job calls these functions at the same point (they are collectives).
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

ShardIndex = tuple[tuple[int, int], ...]  # (start, stop) per dimension of the global array


def shard_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> ShardIndex:
    """A shard's place in the global array as plain numbers (a key that survives JSON)."""
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


def index_size(index: ShardIndex) -> int:
    return math.prod(stop - start for start, stop in index)


@lru_cache(maxsize=None)
def process_grid(devices: tuple) -> np.ndarray:
    """jax's devices as [process, local device], each row one process's devices in id order."""
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    rows = [sorted(by_process[p], key=lambda d: d.id) for p in sorted(by_process)]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("the processes hold different numbers of devices; the local checkpoint tier needs equal ones")
    return np.array(rows, dtype=object)


def _grid_mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(process_grid(tuple(jax.devices())), ("process", "local"))


def device_indices(array_sharding, shape) -> dict:
    """{device: ShardIndex} over every device of the job."""
    return {d: shard_index(idx, shape) for d, idx in array_sharding.devices_indices_map(tuple(shape)).items()}


@lru_cache(maxsize=None)
def _permute_fn(mesh, perm: tuple[tuple[int, int], ...]):
    spec = P("process", "local")

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    def send(blocks):
        return jax.lax.ppermute(blocks, "process", perm)

    return send


def send_blocks(blocks_by_device: dict, dtype, width: int, perm: tuple[tuple[int, int], ...]) -> dict:
    """blocks_by_device: this process's {local device: 1-D host array of at most `width` elements} (missing
    devices send zeros). Returns {local device: the 1-D block (length width) its peer device sent}, on the host.
    perm: (sending process, receiving process) pairs; a process that receives nothing gets zeros."""
    mesh = _grid_mesh()
    grid = mesh.devices
    me = jax.process_index()
    local = list(grid[me])
    arrays = []
    for d in local:
        block = np.zeros((1, 1, width), dtype)
        data = blocks_by_device.get(d)
        if data is not None:
            block[0, 0, :data.size] = data.reshape(-1)
        arrays.append(jax.device_put(block, d))
    sharding = NamedSharding(mesh, P("process", "local"))
    global_blocks = jax.make_array_from_single_device_arrays((grid.shape[0], grid.shape[1], width), sharding,
                                                             arrays)
    received = _permute_fn(mesh, perm)(global_blocks)
    out = {}
    for shard in received.addressable_shards:
        out[shard.device] = np.asarray(shard.data).reshape(-1)
    return out


def peer_process(owner: int, offset: int, process_count: int) -> int:
    """The process that keeps a copy of `owner`'s shards."""
    return (owner + offset) % process_count


def own_shards(leaf: jax.Array) -> dict:
    """{ShardIndex: host array}: the distinct shards of `leaf` this process's devices hold. Copies: on CPU np.asarray
    may alias the device buffer, which the next step reuses (the state is donated) while a background writer reads."""
    out = {}
    for shard in leaf.addressable_shards:
        out.setdefault(shard_index(shard.index, tuple(leaf.shape)), np.array(shard.data))
    return out


def _layout(array_sharding, shape) -> tuple[dict, int]:
    """({device: ShardIndex} over the job, the block width: the largest shard's element count)."""
    indices = device_indices(array_sharding, tuple(shape))
    return indices, max(1, max(index_size(i) for i in indices.values()))


def _unpack(received: dict, indices: dict, source: int) -> dict:
    """{ShardIndex: array} of the blocks this process's devices received, each the shard that local device j of
    process `source` holds."""
    grid = process_grid(tuple(jax.devices()))
    out = {}
    for j, d in enumerate(grid[jax.process_index()]):
        index = indices[grid[source][j]]
        out.setdefault(index, received[d][:index_size(index)].reshape([b - a for a, b in index]))
    return out


def exchange_leaf(leaf: jax.Array, perm: tuple[tuple[int, int], ...]) -> tuple[dict, dict]:
    """(this process's own unique shards of `leaf`, the unique shards the process sending to it owns), each as
    {ShardIndex: host array}. perm: (owner, holder) pairs."""
    indices, width = _layout(leaf.sharding, leaf.shape)
    own = own_shards(leaf)
    blocks = {shard.device: own[shard_index(shard.index, tuple(leaf.shape))] for shard in leaf.addressable_shards}
    received = send_blocks(blocks, leaf.dtype, width, perm)
    sender = {holder: owner for owner, holder in perm}.get(jax.process_index())
    return own, ({} if sender is None else _unpack(received, indices, sender))


def return_leaf(shape, dtype, array_sharding, held: dict | None, perm: tuple[tuple[int, int], ...]) -> dict:
    """The reverse trip: each holder sends the copy it keeps (`held`: {ShardIndex: host array} of the owner's
    shards, None when it keeps none that is needed) back to its owner. perm: (holder, owner) pairs. Returns
    {ShardIndex: host array} of the shards this process received (empty when it received none)."""
    indices, width = _layout(array_sharding, shape)
    grid = process_grid(tuple(jax.devices()))
    me = jax.process_index()
    owner = dict(perm).get(me)
    blocks = {}
    if held is not None and owner is not None:
        for j, d in enumerate(grid[me]):
            blocks[d] = held[indices[grid[owner][j]]]
    received = send_blocks(blocks, jnp.dtype(dtype), width, perm)
    return _unpack(received, indices, me) if me in {o for _, o in perm} else {}
