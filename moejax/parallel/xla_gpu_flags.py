"""The XLA:GPU flags moejax sets for GPU runs so that collectives can run under compute: each one the user has not
set in XLA_FLAGS is added before jax starts its backends (a no-op after), and the flags in effect are printed on
GPUs. Other backends ignore them. They are the ones the JAX and NVIDIA JAX-Toolbox GPU performance guides give for
LLM training; what each does for a moejax step is beside it. Measured on the compiled program (deviceless
XLA:GPU, DeepSeek-V3-small on 8 H200s): the expert exchange's bytes with compute scheduled under them 18% -> 63%,
the gradient reductions' 0-39% -> 100%, for 15% more temp memory (the double buffers)."""

from __future__ import annotations

import os
import re

# flag -> (value, what it does for a moejax step)
OVERLAP_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": (
        "true", "schedules each asynchronous collective's start early and its done late, around independent "
                "compute, by a cost model of both"),
    "xla_gpu_enable_pipelined_all_gather": (
        "true", "moves the next layer's fsdp weight all-gather of the layer scan into the current iteration, so "
                "it runs under this layer's compute"),
    "xla_gpu_enable_pipelined_reduce_scatter": (
        "true", "moves the layer's gradient reduce-scatter into the next backward iteration, under its compute"),
    "xla_gpu_enable_pipelined_all_reduce": (
        "true", "the same for gradient all-reduces (data-parallel replicas of the expert weights)"),
    "xla_gpu_enable_while_loop_double_buffering": (
        "true", "unrolls the layer scan by two with double buffers, which gives the scheduler two layers' work "
                "to overlap collectives with"),
}
_SET = re.compile(r"--(?P<name>xla_[a-z0-9_]+)(?:=(?P<value>\S*))?")


def user_set(xla_flags: str) -> dict[str, str]:
    """{flag name: value} of the flags an XLA_FLAGS string sets."""
    return {m["name"]: m["value"] or "true" for m in _SET.finditer(xla_flags)}


def add_overlap_flags(environ=os.environ) -> dict[str, str]:
    """Adds each of OVERLAP_FLAGS that XLA_FLAGS does not set; returns {flag: value} in effect for all of them,
    the user's where given. Call before jax initialises its backends."""
    given = user_set(environ.get("XLA_FLAGS", ""))
    added = [f"--{name}={value}" for name, (value, _) in OVERLAP_FLAGS.items() if name not in given]
    if added:
        environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", ""), *added]).strip()
    return {name: given.get(name, value) for name, (value, _) in OVERLAP_FLAGS.items()}


def describe(in_effect: dict[str, str]) -> str:
    """The line printed on GPUs: which overlap flags are in effect and that XLA_FLAGS overrides them."""
    return ("XLA:GPU overlap flags (moejax's defaults; set any in XLA_FLAGS to override): "
            + " ".join(f"--{k}={v}" for k, v in in_effect.items()))


# XLA:GPU's memory budget for its latency-hiding scheduler and rematerialisation (gpu_hlo_schedule.cc,
# GetSchedulerMemoryLimit): (base - the program's arguments and outputs) x slop / 100. The base is the memory the
# compile is given: on a GPU jax passes its allocator's limit (XLA_PYTHON_CLIENT_MEM_FRACTION of the memory); a
# deviceless compile has none and XLA takes 80% of the target's memory. Over the budget, the scheduler orders the
# program to lower its peak and leaves collectives synchronous: the overlap that memory would buy is gone.
MEMORY_LIMIT_SLOP_FLAG = "xla_gpu_memory_limit_slop_factor"
# The share of each GPU's memory moejax's launch scripts give XLA's allocator (XLA_PYTHON_CLIENT_MEM_FRACTION; jax's
# own default is 0.75): the rest holds the CUDA context, NCCL's buffers and cuBLAS workspaces. The planner budgets
# XLA:GPU's scheduler at it.
LAUNCH_MEM_FRACTION = 0.95
XLA_DEFAULT_SLOP_PERCENT = 95
DEVICELESS_BASE_SHARE = 0.8


def slop_percent(xla_flags: str) -> int:
    """The --xla_gpu_memory_limit_slop_factor in effect (XLA's default 95)."""
    return int(user_set(xla_flags).get(MEMORY_LIMIT_SLOP_FLAG, XLA_DEFAULT_SLOP_PERCENT))


def scheduler_memory_limit(base_bytes: int, io_bytes: int, slop: int) -> int:
    """Bytes of temporaries XLA:GPU's scheduler plans for (0 where the arguments alone exceed the base)."""
    return max(0, (base_bytes - io_bytes) * slop // 100)


def scheduler_slop_for(mem_fraction: float, device_bytes: int, io_bytes: int, slop: int = XLA_DEFAULT_SLOP_PERCENT) -> int:
    """The slop factor that gives a deviceless compile (base: 80% of the target's memory) the scheduler budget of a
    GPU run whose allocator holds mem_fraction of it: (F M - io) x slop = (0.8 M - io) x slop', rounded down (XLA's
    flag is an integer: the budget within 1% of the run's). io: the arguments' bytes per device, as estimated before
    the compile. Raises ValueError where the deviceless base cannot carry a budget (the arguments exceed it)."""
    deviceless = int(device_bytes * DEVICELESS_BASE_SHARE) - io_bytes
    if deviceless <= 0:
        raise ValueError(f"the arguments ({io_bytes / 2**30:.1f} GiB per device) exceed XLA:GPU's deviceless base "
                         f"({DEVICELESS_BASE_SHARE:.0%} of {device_bytes / 2**30:.1f} GiB): no slop factor gives its "
                         "scheduler a budget")
    return max(0, int(mem_fraction * device_bytes) - io_bytes) * slop // deviceless


def scheduler_memory_note(base_bytes: int, device_bytes: int, io_bytes: int, temp_bytes: int, slop: int) -> str | None:
    """One line when the compiled program's temporaries exceed the scheduler's budget (it then scheduled for memory,
    not overlap), with the slop factor that would give the scheduler the device's whole memory; None otherwise."""
    limit = scheduler_memory_limit(base_bytes, io_bytes, slop)
    if temp_bytes <= limit:
        return None
    gib = 2**30
    if io_bytes >= base_bytes:  # XLA budgets nothing then, whatever the slop
        return (f"the arguments ({io_bytes / gib:.1f} GiB) exceed XLA:GPU's base ({base_bytes / gib:.1f} GiB): its "
                "scheduler had no memory budget and scheduled for memory, so its collectives run mostly synchronously")
    whole = -(-100 * (device_bytes - io_bytes) // (base_bytes - io_bytes))  # ceil: limit = device - io
    return (f"XLA:GPU's scheduler planned for {limit / gib:.1f} GiB of temporaries ((base {base_bytes / gib:.1f} - "
            f"arguments {io_bytes / gib:.1f} GiB) x {slop}%) and the program needs {temp_bytes / gib:.1f}: it "
            "scheduled for memory, so its collectives run mostly synchronously; "
            f"--{MEMORY_LIMIT_SLOP_FLAG}={whole} in XLA_FLAGS budgets the device's whole "
            f"{device_bytes / gib:.1f} GiB (more overlap, more temporaries)")
