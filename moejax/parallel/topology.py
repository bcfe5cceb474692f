"""Hardware descriptions as data: what one device can compute and hold, and what each link class moves.

A topology is a set of NVLink domains (an NVL72 rack, an HGX node) joined by NICs. Per device: peak dense
bf16/fp8 FLOP/s (the MFU denominators), HBM size and bandwidth. Per link class, the
bandwidth one device gets each way: `nvlink` inside the domain, `nic` across domains. Sources: NVIDIA's
datasheets (HBM, NVLink generation, NIC per GPU); numbers are nominal, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from moejax.errors import InputError

GB = 1e9


@dataclass(frozen=True)
class Topology:
    name: str
    device: str  # the GPU's name as JAX's device_kind reports it (substring), for auto-detection
    domain_size: int  # devices per NVLink domain
    devices_per_process: int  # devices one launched process usually drives (a GB tray: 4, an HGX node: 8)
    peak_bf16: float  # dense FLOP/s per device
    peak_fp8: float
    hbm_bytes: float  # per device
    hbm_bw: float  # bytes/s per device
    nvlink_bw: float  # bytes/s per device, each way, to any device in its domain
    nic_bw: float  # bytes/s per device, each way, to other domains
    notes: str = ""

    def link_bw(self, link: str) -> float:
        return {"nvlink": self.nvlink_bw, "nic": self.nic_bw}[link]


TOPOLOGIES: dict[str, Topology] = {t.name: t for t in (
    Topology("gb300-nvl72", "GB300", 72, 4, 2.5e15, 5e15, 288 * GB, 8e12, 900 * GB, 100 * GB,
             "72 Blackwell Ultra GPUs per NVLink 5 domain (18 trays x 4), one 800 Gb/s ConnectX-8 per GPU"),
    Topology("gb200-nvl72", "GB200", 72, 4, 2.5e15, 5e15, 186 * GB, 8e12, 900 * GB, 50 * GB,
             "72 Blackwell GPUs per NVLink 5 domain (18 trays x 4), one 400 Gb/s ConnectX-7 per GPU"),
    Topology("hgx-b200", "B200", 8, 8, 2.25e15, 4.5e15, 180 * GB, 8e12, 900 * GB, 50 * GB,
             "8 GPUs per NVLink 5 node, one 400 Gb/s ConnectX-7 per GPU"),
    Topology("hgx-h200", "H200", 8, 8, 989e12, 1979e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB,
             "8 GPUs per NVLink 4 node, one 400 Gb/s ConnectX-7 per GPU"),
    Topology("hgx-h100", "H100", 8, 8, 989e12, 1979e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB,
             "8 GPUs per NVLink 4 node, one 400 Gb/s ConnectX-7 per GPU"),
    # Emulated CPU devices: every device of the process is one domain unless mesh.domain_size says
    # otherwise. FLOP/s and bandwidths are placeholders (the train loop measures the CPU's matmul rate).
    Topology("cpu", "cpu", 0, 0, 250e9, 250e9, 24 * GB, 10 * GB, 10 * GB, 10 * GB,
             "emulated devices sharing the host; domain size from mesh.domain_size (0: all devices)"),
)}


class TopologyError(InputError, ValueError):
    """An unknown topology name, or devices that do not fit the topology; the message says what to change."""


def check_topology_name(name: str):
    """mesh.topology is 'auto' or a known topology (for validation before anything compiles)."""
    if name != "auto" and name not in TOPOLOGIES:
        raise TopologyError(f"mesh.topology={name!r} is not one of {', '.join(map(repr, ('auto', *TOPOLOGIES)))}")


def get_topology(name: str) -> Topology:
    if name not in TOPOLOGIES:
        raise TopologyError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}")
    return TOPOLOGIES[name]


def detect_topology(device_kind: str, platform: str) -> Topology:
    """The topology whose GPU name appears in device_kind (longest name first: GB200 before B200)."""
    if platform == "cpu":
        return TOPOLOGIES["cpu"]
    kind = device_kind.upper()
    for t in sorted(TOPOLOGIES.values(), key=lambda t: -len(t.device)):
        if t.device.upper() in kind:
            return t
    raise TopologyError(f"no topology known for device kind {device_kind!r}; set mesh.topology to one of "
                        f"{', '.join(TOPOLOGIES)}")


def device_domains(devices, topology: Topology, domain_size: int = 0) -> list[int]:
    """NVLink domain index of each device, in the given order.

    domain_size > 0 (an override: emulation, or a job that uses 64 of a rack's 72 GPUs) or a device
    without `slice_index`: devices ordered by (process_index, id) fill consecutive domains of that many
    (launchers number processes rack by rack). Otherwise the platform's `slice_index` is the domain.
    """
    size = domain_size or topology.domain_size
    reported = [getattr(d, "slice_index", None) for d in devices]
    if not domain_size and all(s is not None for s in reported):
        return [int(s) for s in reported]
    order = sorted(range(len(devices)), key=lambda i: (devices[i].process_index, devices[i].id))
    if size <= 0:
        size = len(devices)
    if len(devices) % size:
        raise TopologyError(
            f"{len(devices)} devices do not fill whole NVLink domains of {size} ({topology.name}); launch a "
            f"multiple of {size} devices or set mesh.domain_size to the devices per domain this job uses")
    rank = {i: r for r, i in enumerate(order)}
    return [rank[i] // size for i in range(len(devices))]
