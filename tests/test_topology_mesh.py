"""NVLink-domain-aware meshes: expert (and tensor) groups never span two domains; impossible requests fail
with a message that says what to change; every process of a job builds the same mesh.

Most cases run on stand-in device objects (id, process_index, slice_index), which need no jax devices;
two run the real builder on 144 and 16 emulated CPU devices in a subprocess.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from moejax.parallel.device_grid import MeshLayoutError, groups_along, hybrid_device_grid
from moejax.parallel.topology import TopologyError, detect_topology, device_domains, get_topology
from cpu_env import cpu_env

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    slice_index: int | None = None
    device_kind: str = "NVIDIA GB300"
    platform: str = "gpu"


def sizes(data=1, fsdp=1, expert=1, tensor=1):
    return dict(data=data, fsdp=fsdp, expert=expert, tensor=tensor)


def domain_of(devices, domains):
    return {d.id: dom for d, dom in zip(devices, domains)}


def assert_groups_inside_domains(grid, dom, axes):
    for group in groups_along(grid, axes):
        assert len({dom[d.id] for d in group}) == 1, [d.id for d in group]


def nvl72_pair_with_slice_index():
    # Two racks whose device ids interleave tray by tray: the builder must follow slice_index, not ids.
    return [FakeDevice(i, i // 4, slice_index=(i // 4) % 2) for i in range(144)]


@pytest.mark.parametrize("layout", [sizes(data=2, fsdp=9, expert=8), sizes(fsdp=4, expert=36),
                                    sizes(data=2, expert=72), sizes(data=18, expert=4, tensor=2),
                                    sizes(data=3, fsdp=2, expert=24)])
def test_144_devices_in_two_nvl72_domains_keep_expert_and_tensor_groups_inside(layout):
    devices = nvl72_pair_with_slice_index()
    domains = device_domains(devices, get_topology("gb300-nvl72"))
    assert sorted(set(domains)) == [0, 1] and domains.count(0) == 72
    grid = hybrid_device_grid(layout, devices, domains)
    assert sorted(d.id for d in grid.reshape(-1)) == list(range(144))
    dom = domain_of(devices, domains)
    assert_groups_inside_domains(grid, dom, ("expert",))
    assert_groups_inside_domains(grid, dom, ("tensor",))
    assert_groups_inside_domains(grid, dom, ("expert", "tensor"))


def test_fsdp_stays_inside_the_domain_when_it_fits_and_data_crosses():
    devices = nvl72_pair_with_slice_index()
    domains = device_domains(devices, get_topology("gb300-nvl72"))
    grid = hybrid_device_grid(sizes(data=2, fsdp=9, expert=8), devices, domains)
    dom = domain_of(devices, domains)
    assert_groups_inside_domains(grid, dom, ("fsdp", "expert"))
    assert all(len({dom[d.id] for d in g}) == 2 for g in groups_along(grid, ("data",)))


def test_an_expert_group_that_would_span_two_domains_is_an_error_that_says_what_to_change():
    devices = nvl72_pair_with_slice_index()
    domains = device_domains(devices, get_topology("gb300-nvl72"))
    with pytest.raises(MeshLayoutError) as e:
        hybrid_device_grid(sizes(data=9, expert=16), devices, domains, where=", gb300-nvl72")
    msg = str(e.value)
    assert "mesh.expert=16 x mesh.tensor=1 = 16 devices per expert group does not divide the 72 devices" in msg
    assert "2 domains, gb300-nvl72" in msg and "8, 9, 12, 18, 24, 36, 72" in msg
    assert "mesh.domain_size" in msg and "mesh.allow_cross_domain_experts=True" in msg
    with pytest.raises(MeshLayoutError, match="devices per expert group does not divide"):
        hybrid_device_grid(sizes(expert=144), devices, domains)
    # Explicitly allowed: the mesh is built, groups may cross.
    grid = hybrid_device_grid(sizes(data=9, expert=16), devices, domains, allow_cross_domain=True)
    assert grid.shape == (1, 9, 1, 1, 16, 1)  # [stage, data, fsdp, context, expert, tensor]


def test_ep32_fits_racks_launched_with_64_gpus_each():
    # The launch files use 16 of 18 trays (64 GPUs) per rack so that 256 experts split into EP32 groups.
    devices = [FakeDevice(i, i // 4) for i in range(128)]
    domains = device_domains(devices, get_topology("gb300-nvl72"), domain_size=64)
    grid = hybrid_device_grid(sizes(data=4, expert=32), devices, domains)
    assert_groups_inside_domains(grid, domain_of(devices, domains), ("expert",))
    with pytest.raises(TopologyError, match="do not fill whole NVLink domains of 72"):
        device_domains(devices, get_topology("gb300-nvl72"))


def test_16_devices_as_two_hgx_nodes_of_8():
    devices = [FakeDevice(i, i // 8, device_kind="NVIDIA H100 80GB HBM3") for i in range(16)]
    topo = detect_topology(devices[0].device_kind, "gpu")
    assert topo.name == "hgx-h100" and topo.domain_size == 8
    domains = device_domains(devices, topo)
    assert domains == [i // 8 for i in range(16)]
    for layout in (sizes(data=2, expert=8), sizes(fsdp=4, expert=4), sizes(data=2, expert=4, tensor=2)):
        grid = hybrid_device_grid(layout, devices, domains)
        assert_groups_inside_domains(grid, domain_of(devices, domains), ("expert", "tensor"))
    with pytest.raises(MeshLayoutError, match="16 devices per expert group does not divide the 8 devices"):
        hybrid_device_grid(sizes(expert=16), devices, domains)


def test_every_process_of_a_multi_process_job_builds_the_same_mesh():
    # 36 processes x 4 GPUs (one per GB300 tray), no slice_index reported: domains come from the topology
    # and the process indices. Each process lists its own devices first, as jax.local_devices() would.
    devices = [FakeDevice(i, i // 4, device_kind="NVIDIA GB300") for i in range(144)]
    topo = get_topology("gb300-nvl72")
    layout = sizes(data=2, fsdp=2, expert=36)
    grids = []
    for me in (0, 17, 18, 35):
        view = sorted(devices, key=lambda d: (d.process_index != me, -d.id))
        domains = device_domains(view, topo)
        grid = hybrid_device_grid(layout, view, domains)
        assert_groups_inside_domains(grid, domain_of(view, domains), ("expert",))
        grids.append([d.id for d in grid.reshape(-1)])
    assert all(g == grids[0] for g in grids)
    # Processes 0-17 (devices 0-71) are rack 0.
    assert device_domains(devices, topo)[71] == 0 and device_domains(devices, topo)[72] == 1


def test_unequal_domains_and_unknown_names_fail_clearly():
    devices = [FakeDevice(i, i // 4, slice_index=0 if i < 72 else 1) for i in range(136)]
    with pytest.raises(MeshLayoutError, match=r"different numbers of devices \(64, 72\)"):
        hybrid_device_grid(sizes(data=17, expert=8), devices, device_domains(devices, get_topology("gb300-nvl72")))
    with pytest.raises(TopologyError, match="unknown topology 'nvl36'"):
        get_topology("nvl36")
    with pytest.raises(TopologyError, match="no topology known for device kind 'Tesla T4'"):
        detect_topology("Tesla T4", "gpu")
    assert detect_topology("NVIDIA GB200", "gpu").name == "gb200-nvl72"
    assert detect_topology("NVIDIA B200", "gpu").name == "hgx-b200"


_EMULATED = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from moejax.parallel.mesh import make_mesh
from moejax.parallel.device_grid import MeshLayoutError
n, domain, layout, bad = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
assert jax.device_count() == n
mesh = make_mesh(layout, topology="cpu", domain_size=domain)
ids = [[d.id for d in row] for row in mesh.devices.transpose(0, 1, 2, 3, 5, 4).reshape(-1, layout["expert"])]
# A real collective over the expert axis on the built mesh: each group sums its members' ids.
f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "expert"), mesh=mesh, in_specs=P(("data", "fsdp", "expert", "tensor")),
                          out_specs=P(("data", "fsdp", "expert", "tensor"))))
summed = f(jnp.arange(n, dtype=jnp.float32))
try:
    make_mesh(bad, topology="cpu", domain_size=domain)
    error = None
except MeshLayoutError as e:
    error = str(e)
print(json.dumps({"expert_groups": ids, "psum_ok": bool(summed.shape == (n,)), "error": error}))
"""


@pytest.mark.parametrize("n,domain,layout,bad", [
    (144, 72, sizes(data=2, fsdp=2, expert=36), sizes(data=9, expert=16)),
    (16, 8, sizes(data=2, expert=4, tensor=2), sizes(expert=16)),
])
def test_emulated_devices_in_fake_domains(n, domain, layout, bad):
    env = cpu_env(n)
    out = subprocess.run([sys.executable, "-c", _EMULATED, str(n), str(domain), json.dumps(layout), json.dumps(bad)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["psum_ok"]
    groups = result["expert_groups"]
    assert len(groups) == n // layout["expert"]
    assert all(len({i // domain for i in g}) == 1 for g in groups), groups
    assert "does not divide" in result["error"]
