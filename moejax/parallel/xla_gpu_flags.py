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
