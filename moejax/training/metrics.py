"""Throughput and MFU from model FLOPs, the per-device peak, and the metric writers (JSONL, TensorBoard, console)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moejax.parallel.topology import TopologyError, detect_topology
from moejax.units import si_prefix

def measure_cpu_peak_flops(size: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of a jitted f32 matmul on one CPU device: what the whole process can do, since XLA:CPU
    runs one matmul on every core."""
    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    n, start = 0, time.perf_counter()
    while True:
        f(a).block_until_ready()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed > seconds:
            return 2 * size**3 * n / elapsed


def measure_matmul_peak(dtype, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of one jitted [n, n] @ [n, n] matmul in `dtype` on the default device: the rate this device
    reaches on a large GEMM in this process, the achievable ceiling MFU is also quoted against. Random data:
    zeros or ones run faster than real data on GPUs."""
    a = jax.random.normal(jax.random.key(2), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(a)
    out.block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def peak_flops_per_device(peak_tflops: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number came from): `hardware.peak_tflops` when set, else the
    GPU's dense bf16 peak from its topology (parallel/topology.py), else measured on CPU."""
    if peak_tflops > 0:
        return peak_tflops * 1e12, "config"
    device = jax.local_devices()[0]
    if device.platform == "gpu":
        try:
            peak = detect_topology(device.device_kind, device.platform).peak_bf16
            return peak, f"table ({device.device_kind}, bf16 dense)"
        except TopologyError:
            pass
    if device.platform == "cpu":
        # The emulated devices share the process's cores, so each gets its share of the measured rate.
        return measure_cpu_peak_flops() / jax.local_device_count(), "measured (f32 matmul / local devices)"
    raise ValueError(f"no peak FLOP/s known for {device.device_kind}; set --config.hardware.peak_tflops")


def throughput(step_time_s: float, tokens_per_step: int, flops_per_token: float, n_devices: int,
               peak_per_device: float) -> dict:
    tokens_per_s = tokens_per_step / step_time_s
    flops_per_device = flops_per_token * tokens_per_s / n_devices
    return {"step_time_s": step_time_s, "tokens_per_s": tokens_per_s,
            "tflops_per_device": flops_per_device / 1e12, "mfu": flops_per_device / peak_per_device}


def to_host(metrics: dict) -> dict:
    """Device metrics -> plain Python (floats, lists) for JSON."""
    out = {}
    for k, v in jax.device_get(metrics).items():
        v = np.asarray(v)
        out[k] = float(v) if v.ndim == 0 else v.tolist()
    return out


def _si(x: float) -> str:
    scaled, prefix = si_prefix(x)
    return f"{scaled:.1f}{prefix}" if prefix else f"{x:.0f}"


def console_line(m: dict, total_steps: int, *, can_drop: bool = True) -> str:
    """One progress line. MoE runs add the expert load balance (the busiest expert's load over the mean, worst
    layer): what sets a dropless step's overflow rounds and a capacity step's drops. can_drop: the dispatch can
    drop tokens (capacity, allgather), so the dropped share is shown; a dropless run never drops and shows its
    overflow rounds instead when there were any."""
    eta_s = m["step_time_s"] * (total_steps - m["step"])
    eta = f"{eta_s / 3600:.1f}h" if eta_s >= 3600 else f"{eta_s / 60:.0f}m" if eta_s >= 60 else f"{eta_s:.0f}s"
    tf = m["tflops_per_device"]
    line = (f"step {m['step']}/{total_steps} | loss {m['loss']:.3f} | {m['step_time_s'] * 1e3:.0f} ms | "
            f"{_si(m['tokens_per_s'])} tok/s | {tf:.3g} TFLOP/s/dev | MFU {100 * m['mfu']:.1f}% | eta {eta}")
    if "expert_imbalance" in m:
        line += f" | load max/mean {m['expert_imbalance']:.2f}"
        if can_drop:
            line += f" drop {100 * m['dropped_fraction']:.1f}%"
        elif m.get("dropless_rounds", 1) > 1:
            line += f" rounds {int(m['dropless_rounds'])}"
    if "eval_loss" in m:
        line += f" | eval {m['eval_loss']:.3f}"
    return line


class MetricsWriter:
    """metrics.jsonl (one object per logged step) and TensorBoard scalars under workdir/tb."""

    def __init__(self, workdir: Path, enabled: bool = True):
        self.enabled = enabled
        self._jsonl = self._tb = None
        if enabled:
            self._jsonl = open(Path(workdir) / "metrics.jsonl", "a")
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(workdir) / "tb"))

    def write(self, m: dict):
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(m) + "\n")
        self._jsonl.flush()
        for k, v in m.items():
            if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                self._tb.add_scalar(k, v, m["step"])
            elif k == "expert_imbalance_per_layer":
                for layer, x in enumerate(v):
                    self._tb.add_scalar(f"expert_imbalance/layer_{layer}", x, m["step"])
            elif k == "tokens_per_expert":  # the distribution of load over experts, per MoE layer
                for layer, row in enumerate(v):
                    self._tb.add_histogram(f"tokens_per_expert/layer_{layer}", np.asarray(row), m["step"])

    def close(self):
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
