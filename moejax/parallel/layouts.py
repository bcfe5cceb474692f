"""Physical layouts of the per-layer weights a layer scan reads.

XLA:GPU gathers (all-gather) and scatters (reduce-scatter) along an array's most major dimension only, so a
weight whose fsdp-split dimension is not its first is laid out with that dimension major where it is gathered.
Layout assignment carries that choice back through the layer's dynamic slice to the whole stacked parameter
the scan reads: XLA then copies every such stacked f32 parameter into the gather's layout before the layer loop
and keeps the copy for the loop's life (DeepSeek-V3 671B at fsdp 2 x expert 32 on GB300: four 13.6 GB copies,
the routed experts' three weights and the attention output, and smaller ones: 53.8 GiB per device).

`block_in_default_layout` pins a layer's slice of the stack to the parameter's own (row-major) layout: the gather's
relayout then happens on the one layer's slice inside the loop, fused with the cast to the compute dtype,
instead of on the whole stack outside it. The gradient gets the same pin (the constraint is linear), so the
stacked gradient is written in the parameter's layout too.
"""

from __future__ import annotations

import jax
from jax.experimental.layout import Layout, with_layout_constraint

from moejax.parallel.mesh import FSDP_AXIS, STAGE_AXIS, constrain, mesh_platform


def in_default_layout(weight, logical_axes):
    """`weight` pinned to its row-major layout, and to its own sharding (by logical names) on both sides of the pin:
    XLA's partitioner does not see through the layout constraint, so without the sharding the gradient's
    reduction around it can turn into a reduce-scatter plus an all-gather (jax 0.10.2, CPU mesh at data 8: +17%
    all-gather bytes without them)."""
    weight = constrain(weight, logical_axes)
    return constrain(with_layout_constraint(weight, Layout(tuple(range(weight.ndim)))), logical_axes)


def block_in_default_layout(variables):
    """Every nnx Variable of a layer's state (nnx.split) pinned by `in_default_layout`, with its logical axes, when
    the program is for GPUs and splits weights over fsdp or pipeline stages; unchanged otherwise. Measured on
    deviceless GB300 compiles of DeepSeek-V3 671B: fsdp 2 x EP32 54 GiB less temp memory, the record's PP2 x VP8 x
    EP32 (no fsdp) 28 GiB less. Without either the pin only moved XLA's schedule (DeepSeek-V3-small at data 2 x
    expert 4: the expert exchange's bytes under a GEMM 66% -> 59%). XLA:CPU has no such gather layout rule, and jax
    0.10's partitioner all-gathers a sharded array around the layout constraint (jax 0.12's keeps its sharding)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(mesh.shape) if mesh_platform(mesh) == "gpu" else {}
    if sizes.get(FSDP_AXIS, 1) == 1 and sizes.get(STAGE_AXIS, 1) == 1:
        return variables

    def pin(var):
        return var.replace(in_default_layout(var.get_value(), var.get_metadata()["logical_axes"]))

    return jax.tree.map(pin, variables, is_leaf=lambda x: hasattr(x, "get_metadata"))
