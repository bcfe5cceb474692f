"""GPU targets for the deviceless compile (`moejax-train --dry_run --dry_run_target T`): XLA:GPU compiles the
real training step for NVIDIA GPUs in a process that has none (jax's CUDA plugin, compile-only devices from
`jax.experimental.topologies`), so memory, kernels and collectives are known before a rack is rented.

Each target is a GpuTargetConfig (XLA's description of one device: SM count, shared memory, memory size and
bandwidth, compute capability) and a host layout (devices per host, hosts per NVLink domain). Numbers are
NVIDIA's published specifications: H200 (Hopper, sm_90: 132 SMs, 141 GB HBM3e at 4.8 TB/s, 50 MB L2), B200
(Blackwell, sm_100: 148 SMs, 180 GB per GPU in HGX/DGX B200, 8 TB/s), GB300 (Blackwell Ultra, sm_103: 160 SMs,
288 GB HBM3e, 8 TB/s). Shared memory (228 KB per SM, 227 KB per block) and register files (64K 32-bit
registers) are the CUDA programming guide's values for compute capabilities 9.0 and 10.x. Without a device
XLA does not autotune: GEMMs get default tiles, which changes speed, not memory or kernels.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass

from moejax.config.schema import ConfigError
from moejax.kernels.resolve import GPU_EXTRA


@dataclass(frozen=True)
class GpuTarget:
    name: str
    device_kind: str
    topology: str  # moejax.parallel.topology name (NVLink domain, links, peaks)
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    l2_bytes: int
    clock_ghz: float
    devices_per_host: int  # HGX: 8 per node; GB300 NVL72: 4 per compute tray
    hosts_per_domain: int  # hosts joined by one NVLink domain: HGX 1, NVL72 18 trays

    @property
    def domain_size(self) -> int:
        return self.devices_per_host * self.hosts_per_domain

    def target_config(self) -> str:
        major, minor = self.compute_capability
        return (
            "gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
            "shared_memory_per_core: 233472 threads_per_core_limit: 2048 "
            f"core_count: {self.sm_count} fpus_per_core: 128 block_dim_limit_x: 2147483647 "
            "block_dim_limit_y: 65535 block_dim_limit_z: 65535 "
            f"memory_bandwidth: {int(self.memory_bandwidth)} l2_cache_size: {self.l2_bytes} "
            f"clock_rate_ghz: {self.clock_ghz} device_memory_size: {self.memory_bytes} "
            "shared_memory_per_block_optin: 232448 "
            f"cuda_compute_capability {{ major: {major} minor: {minor} }} "
            "registers_per_core_limit: 65536 registers_per_block_limit: 65536 } "
            'platform_name: "CUDA" dnn_version_info { major: 9 minor: 8 } runtime_version { major: 12 minor: 8 } '
            f'device_description_str: "{self.device_kind}"'
        )

    def hosts_used_per_domain(self, n_devices: int) -> int:
        """Hosts of each NVLink domain a job of n devices uses: all of them when it fills whole domains, else the
        most that split it evenly (NVL72 at 256 GPUs: 16 of each rack's 18 trays, 64 of its 72 GPUs, as the record
        runs and launch/ and the planner lay out jobs)."""
        per_host = min(self.devices_per_host, n_devices)
        if n_devices % per_host:
            raise ConfigError(f"--dry_run_target {self.name}: {n_devices} devices do not fill hosts of {per_host}")
        hosts = n_devices // per_host
        if hosts <= self.hosts_per_domain:
            return hosts
        return max(d for d in range(1, self.hosts_per_domain + 1) if hosts % d == 0)

    def used_domain_size(self, n_devices: int) -> int:
        """GPUs of each NVLink domain a job of n devices uses (hosts_used_per_domain x devices per host)."""
        return self.hosts_used_per_domain(n_devices) * min(self.devices_per_host, n_devices)

    def topology_string(self, n_devices: int) -> str:
        """XLA's 'partitions x hosts per partition x devices per host' for n devices: an NVLink domain is a
        partition (the compile-only devices' slice_index), so expert groups can be placed inside one. A job that
        does not fill whole domains uses the same number of hosts of each (hosts_used_per_domain)."""
        per_host = min(self.devices_per_host, n_devices)
        per_domain = self.hosts_used_per_domain(n_devices)
        return f"{n_devices // per_host // per_domain}x{per_domain}x{per_host}"


GB = 10**9
TARGETS: dict[str, GpuTarget] = {t.name: t for t in (
    GpuTarget("h200", "NVIDIA H200", "hgx-h200", (9, 0), 132, 141 * GB, 4.8e12, 50 * 2**20, 1.98, 8, 1),
    GpuTarget("b200", "NVIDIA B200", "hgx-b200", (10, 0), 148, 180 * GB, 8e12, 126 * 2**20, 1.965, 8, 1),
    GpuTarget("gb300", "NVIDIA GB300", "gb300-nvl72", (10, 3), 160, 288 * GB, 8e12, 126 * 2**20, 2.03, 4, 18),
)}


def get_target(name: str) -> GpuTarget:
    if name not in TARGETS:
        raise ConfigError(f"--dry_run_target {name!r} is not one of {', '.join(sorted(TARGETS))}")
    return TARGETS[name]


def check_gpu_compile_installed(target: GpuTarget):
    """One line naming what to install when jax's CUDA plugin (XLA:GPU) or tokamax (the GPU kernels) is
    missing; before anything is compiled or written."""
    missing = [] if _has_cuda_plugin() else ["jax's CUDA plugin"]
    missing += [] if importlib.util.find_spec("tokamax") else ["tokamax"]
    if missing:
        raise ConfigError(f"--dry_run_target {target.name} compiles with XLA:GPU, which needs "
                          f"{' and '.join(missing)}: {GPU_EXTRA}")


def _has_cuda_plugin() -> bool:
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))
    except ModuleNotFoundError:
        return False


def compile_only_devices(target: GpuTarget, n_devices: int):
    """n compile-only GPU devices of the target (platform 'gpu', device_kind the target's)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=target.target_config(),
                                        topology=target.topology_string(n_devices))
    return list(topo.devices)


@contextlib.contextmanager
def cross_compiling(device):
    """Lowering for a GPU from a CPU process: jax's default device is the compile-only GPU (kernel libraries
    ask it what they run on), and tokamax's cross-compile switch turns off its hardware checks."""
    import jax
    import tokamax

    with jax.default_device(device), tokamax.config.cross_compile(True):
        yield


def prepare_process_for_gpu_compile():
    """Before jax starts: only the CPU backend initialises (the CUDA plugin is used to compile, not to run, and
    without a driver it would print a cuInit error and fall back)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
