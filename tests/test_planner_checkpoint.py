"""The planner's checkpoint size and save time (moejax/planner/checkpoint_io.py) against the real train state: the
total is the abstract state's leaves; what each node writes to the persistent directory is what orbax's own
replica slicing gives on real sharded arrays; the local tier's bytes per node are a hand count from jax's shard
indices of each leaf (one copy per process)."""

import contextlib
import io
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.serialization import replica_slices

from moejax import load_config
from moejax.cli import plan as plan_cli
from moejax.parallel.mesh import make_mesh
from moejax.planner.checkpoint_io import GB, checkpoint_cost
from moejax.planner.layout import Layout, layout_config
from moejax.planner.memory import state_memory
from moejax.program.optim import make_optimizer
from moejax.program.state import abstract_state, train_state_shardings

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GPUS_PER_NODE = 4  # 8 emulated devices as 2 nodes


def _layout(**axes):
    sizes = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, **axes}
    return Layout(**sizes, remat="none", micro_batch=1, dispatch="dropless")


def _state(cfg, layout, devices):
    """The abstract train state's leaves with their shardings on a mesh of the layout."""
    cfg = layout_config(cfg, layout)
    abstract = abstract_state(cfg, make_optimizer(cfg.optim))
    shardings = train_state_shardings(cfg, abstract, make_mesh(layout.sizes, devices))
    return jax.tree.leaves(abstract), jax.tree.leaves(shardings)


def _node(device) -> int:
    return device.id // GPUS_PER_NODE


@pytest.fixture(scope="module")
def tiny():
    return load_config(CONFIGS / "tiny.py")  # a distributed optimizer: the moments split over data


@pytest.fixture(scope="module", params=["moments over data", "moments as params"])
def either(request, tiny):
    if request.param == "moments over data":
        return tiny
    cfg = tiny.copy_and_resolve_references()
    cfg.optim.state_sharding = "params"
    return cfg


LAYOUTS = [_layout(data=8), _layout(fsdp=8), _layout(data=2, expert=4), _layout(fsdp=2, expert=2, tensor=2),
           _layout(stage=2, fsdp=4)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name().split(" |")[0])
def test_total_is_the_abstract_states_leaves(tiny, layout, devices):
    leaves, _ = _state(tiny, layout, devices)
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)  # step included
    assert checkpoint_cost(tiny, layout, gpus_per_node=GPUS_PER_NODE).total_bytes == total


@pytest.mark.parametrize("replica_parallel", [True, False], ids=["replica-parallel", "replica-0"])
@pytest.mark.parametrize("layout", LAYOUTS[:4], ids=lambda lay: lay.name().split(" |")[0])
def test_persistent_bytes_per_node_are_orbaxs_replica_slices(either, layout, replica_parallel, devices):
    """orbax's get_replica_slices on the real sharded arrays: the bytes each device writes, summed by node."""
    leaves, shardings = _state(either, layout, devices)
    per_node = np.zeros(2)
    for x, sharding in zip(leaves, shardings, strict=True):
        array = jax.device_put(np.zeros(x.shape, x.dtype), sharding)
        written = replica_slices.get_replica_slices(array, replica_id=0, use_replica_parallel=replica_parallel)
        for rslice in written.replica_slices:
            shape = list(written.local_shape)
            if rslice.slice_args is not None:
                shape[rslice.slice_args.axis] = rslice.slice_args.limit_index - rslice.slice_args.start_index
            per_node[_node(next(iter(rslice.unsliced_data.devices())))] += math.prod(shape) * x.dtype.itemsize
    cost = checkpoint_cost(either, layout, gpus_per_node=GPUS_PER_NODE, replica_parallel=replica_parallel)
    assert (cost.persistent_node_bytes, cost.persistent_node_bytes_min) == (per_node.max(), per_node.min())
    assert per_node.sum() == cost.total_bytes  # each array once
    if layout.data == 8 and not replica_parallel and either.optim.state_sharding == "params":
        assert per_node.tolist() == [cost.total_bytes, 0]  # all replicated: device 0 holds every replica 0


@pytest.mark.parametrize("gpus_per_process", [1, 2, 4])
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[3]], ids=lambda lay: lay.name().split(" |")[0])
def test_local_bytes_per_node_are_each_processs_distinct_shards(either, layout, gpus_per_process, devices):
    leaves, shardings = _state(either, layout, devices)
    own = np.zeros(2)
    for x, sharding in zip(leaves, shardings, strict=True):
        held = {}  # (process, shard index) -> bytes
        for device, index in sharding.devices_indices_map(x.shape).items():
            shape = [len(range(*s.indices(n))) for s, n in zip(index, x.shape)]
            key = (device.id // gpus_per_process, tuple((s.start, s.stop) for s in index))
            held[key] = (_node(device), math.prod(shape) * x.dtype.itemsize)
        for node, nbytes in held.values():
            own[node] += nbytes
    cost = checkpoint_cost(either, layout, gpus_per_node=GPUS_PER_NODE, gpus_per_process=gpus_per_process)
    assert cost.local_own_bytes == own.max() and cost.local_disk_bytes == 2 * own.max()
    if layout.data == 8 and gpus_per_process == GPUS_PER_NODE and either.optim.state_sharding == "params":
        assert cost.local_own_bytes == cost.total_bytes  # all replicated: each node holds the whole state once
    if gpus_per_process == 1:  # a process per GPU holds the device's state as the memory planner counts it
        assert cost.local_own_bytes == GPUS_PER_NODE * (state_memory(either, layout).state + 4)


def test_times_are_bytes_over_the_stated_bandwidths(tiny):
    layout = _layout(data=2, expert=4)
    cost = checkpoint_cost(tiny, layout, gpus_per_node=GPUS_PER_NODE, replica_parallel=False, persistent_gbps=0.02,
                           node_persistent_gbps=0.01, local_write_gbps=0.005, peer_link_gbps=0.1)
    assert cost.persistent_save_s == max(cost.total_bytes / (0.02 * GB), cost.persistent_node_bytes / (0.01 * GB))
    assert cost.peer_send_s == cost.local_own_bytes / (0.1 * GB)
    assert cost.local_write_s == 2 * cost.local_own_bytes / (0.005 * GB)
    with pytest.raises(ValueError, match="nodes of 3"):
        checkpoint_cost(tiny, layout, gpus_per_node=3)


def test_moejax_plan_prints_the_table_only_with_the_flag():
    args = ["moejax-plan", "--config", str(CONFIGS / "tiny.py"), "--topology", "cpu", "--gpus", "8", "--remat",
            "none", "--dispatch", "dropless", "--top", "1", "--layout", "fsdp=8,remat=none,dispatch=dropless"]
    outputs = []
    try:
        for extra in ([], ["--checkpoint", "--checkpoint_assume", "gpus_per_node=4,persistent_gbps=0.5"],
                      ["--checkpoint", "--checkpoint_assume", "disk=3"]):
            plan_cli.FLAGS.unparse_flags()  # absl keeps parsed values (and appends to --layout's) across calls
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                outputs.append((plan_cli.main(args + extra), out.getvalue(), err.getvalue()))
    finally:
        plan_cli.FLAGS.unparse_flags()
    (rc_plain, plain, _), (rc_table, with_table, _), (rc_bad, _, bad) = outputs
    assert (rc_plain, rc_table, rc_bad) == (0, 0, 2)
    assert with_table.startswith(plain) and "checkpoint" not in plain
    table = with_table[len(plain):]
    assert "nodes of 4 GPUs" in table and "0.5 GB/s in all" in table
    assert "best" in table and "candidate fsdp8 | remat none | mb 1 | dropless" in table
    assert "'disk' is not one of" in bad
