"""A mesh emulated in CPU devices where there is no accelerator: the device count a mesh config names, and the XLA
flag that asks jax for that many CPU devices. jax-free: it must run before jax starts its backends."""

from __future__ import annotations

import math
import os

from moejax.config import MESH_AXES

DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"


def mesh_device_count(mesh_cfg) -> int:
    """The device count a mesh config names: the product of its axes; with an axis of -1 (whatever the devices
    leave), the smallest multiple of the other axes' product that is at least 8 (the emulated CPU mesh the
    tests and the tiny configs use)."""
    fixed = math.prod(max(1, int(mesh_cfg[a])) for a in MESH_AXES)
    if all(int(mesh_cfg[a]) != -1 for a in MESH_AXES):
        return fixed
    return fixed * max(1, -(-8 // fixed))


def has_device_count_flag() -> bool:
    """Whether XLA_FLAGS already says how many CPU devices to make."""
    return DEVICE_COUNT_FLAG in os.environ.get("XLA_FLAGS", "")


def request_cpu_devices(n_devices: int) -> None:
    """Asks for n_devices CPU devices (XLA_FLAGS; read when jax starts its backends, a no-op after)."""
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --{DEVICE_COUNT_FLAG}={n_devices}".strip()
