"""The XLA flags of the CPU test suite, for this process (conftest.py) and the training processes tests start.

`--xla_backend_optimization_level=0` turns off LLVM's optimisation of XLA:CPU's generated code: the suite's
programs are tiny, so their compile time (measured 2026-12-04: a small model's state init 12.2 -> 3.8 s, its
training step 11.7 -> 5.1 s) dwarfs their run time. HLO passes (fusion, SPMD partitioning, buffer assignment: what
the tests assert on) are unchanged; tolerances cover the floating-point contraction differences."""

from __future__ import annotations

import os

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int = 8) -> str:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


def cpu_env(devices: int = 8, **extra) -> dict:
    """os.environ for a subprocess on `devices` emulated CPU devices, compiled like the suite."""
    return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu", **extra)
