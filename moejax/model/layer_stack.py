"""Layer stacks: how a stack of blocks is stored (the MoE stack's slots under pipeline stages) and run (a scan over
the layers with the model's remat policy, or over their KV caches when decoding), and the remat policies by name.

A stack is blocks with every variable stacked on a leading layers dim (model/transformer.py builds them). Without
stages, and for an even split without virtual stages, the MoE stack is stored [L, ...]; with virtual stages or an
uneven split in padded chunk slots [V, S C, ...] (StackLayout), which the pipeline's schedules take as chunks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moejax.config.layers import layer_plan
from moejax.model.layers import LAYERS_AXIS_METADATA
from moejax.parallel.layouts import block_in_default_layout
from moejax.parallel.pipeline import chunk_slots, layer_slots, to_chunks
from moejax.remat_names import ATTENTION_OUT, EXPERT_EXCHANGE, EXPERT_GEMM

# The pipelined MoE stack's layer dim is split over the `stage` mesh axis; with virtual stages or an uneven split it is
# stored in chunk slots [V, S C] (moe_stack_layout: repeat r, stage s, slot j at [r, s C + j]), so each stage's chunks
# are a contiguous slice of dim 1.
STAGE_LAYERS_AXIS_METADATA = {nnx.PARTITION_NAME: "stage_layers", "logical_axes": "stage_layers"}

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # Selective: keep what is expensive to recompute, by the names the kernels tag (moejax/remat_names.py).
    "attention": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT),
    "moe": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT, EXPERT_EXCHANGE, EXPERT_GEMM),
}


class StackLayout(NamedTuple):
    """How the MoE stack's variables are stored: leading dims `lead` ([L], or [V, S C] for a pipelined model with
    virtual stages or an uneven split) over `n_slots` = prod(lead) slots, layer l in slot `slots[l]` (layer order;
    the other slots are an uneven split's identity slots, zeros)."""

    lead: tuple[int, ...]
    slots: tuple[int, ...]  # [L] (a tuple: the model keeps it as a static attribute)

    @property
    def n_slots(self) -> int:
        return int(np.prod(self.lead))

    def to_slots(self, a_LxR):
        """[L, ...] in layer order -> lead + [...]: layer l at slot slots[l], zeros in the identity slots."""
        rest = a_LxR.shape[1:]
        padded = jnp.zeros((self.n_slots, *rest), a_LxR.dtype).at[np.asarray(self.slots)].set(a_LxR)
        return padded.reshape(*self.lead, *rest)

    def from_slots(self, a, axis: int = 0):
        """An array with the n_slots slots flat at `axis` -> the layers there, in layer order (identity slots out)."""
        return jnp.take(a, np.asarray(self.slots), axis=axis)


def moe_stack_layout(cfg) -> StackLayout:
    """The MoE stack's storage for this config: [L] without stages and for an even split without virtual stages (the
    stage count alone changes no shape); [V, S C] (padded chunks, parallel/pipeline.py's layer_slots) otherwise."""
    n_moe = layer_plan(cfg.model).n_moe
    stages, virtual = int(cfg.mesh.get("stage", 1)), int(cfg.mesh.get("virtual_stages", 1))
    if stages <= 1 or n_moe == 0:
        return StackLayout((n_moe,), tuple(range(n_moe)))
    slots = tuple(int(i) for i in layer_slots(n_moe, stages, virtual))
    n_slots = chunk_slots(n_moe, stages, virtual) * stages * virtual
    lead = (n_slots,) if virtual == 1 else (virtual, n_slots // virtual)
    return StackLayout(lead, slots)


def _to_slots(blocks, layout: StackLayout):
    """Stacked [L, ...] variables -> layout.lead + [...] (StackLayout.to_slots), a leading 'repeat' name with virtual
    stages."""
    for _, var in nnx.iter_graph(blocks):
        if isinstance(var, nnx.Variable):
            var.set_value(layout.to_slots(var.get_value()))
            if len(layout.lead) > 1:
                var.set_metadata(logical_axes=("repeat", *var.get_metadata()["logical_axes"]))


def _as_chunks(state, n_stages: int, n_repeats: int):
    """The pipelined stack's variables as [V, S, L / (S V), ...] chunks, named like a plain layer stack (what
    _run_stack scans over once the pipeline has taken V and S off)."""

    def chunk(var):
        names = var.get_metadata()["logical_axes"]
        value = var.get_value()
        per_layer = value.shape[2:] if n_repeats > 1 else value.shape[1:]
        value = to_chunks(value.reshape(-1, *per_layer), n_stages, n_repeats)
        return var.replace(value, logical_axes=("layers", *names[len(names) - len(per_layer):]))

    return jax.tree.map(chunk, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


LAYER_INPUT = "layer_input"  # checkpoint name of every stacked block's input


def _tick_policy(remat: str):
    """A pipeline tick's remat policy with virtual stages: keep what the layers' own policy keeps (their inputs,
    and under `dots` the matmul outputs) so that only the tick's chunk of weights is re-selected in the backward;
    None under remat none (the tick keeps everything, a copy of the chunk's weights included)."""
    if remat == "none":
        return None
    return jax.checkpoint_policies.save_from_both_policies(
        _REMAT_POLICIES[remat], jax.checkpoint_policies.save_only_these_names(LAYER_INPUT))


def _remat(fn, remat: str):
    return fn if remat == "none" else nnx.remat(fn, policy=_REMAT_POLICIES[remat])


def _layer_range(blocks, start: int, stop: int):
    """Layers [start, stop) of stacked blocks, as stacked blocks (a slice of every variable's layer dim)."""
    graphdef, state = nnx.split(blocks)
    state = jax.tree.map(lambda var: var.replace(var.get_value()[start:stop]), state,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def _run_stack(blocks, x_BxLxD, positions_BxL, segment_ids_BxL, remat: str, is_layer_L=None):
    """The stacked blocks in order. is_layer_L: [L] bool or None; a False slot (an uneven pipeline split's
    identity slot) passes its input through (its block still runs: stages compute in lockstep)."""
    def layer(block, x, positions, segments):
        # Inside the remat: the pinned slice is recomputed from the stack in the backward, not saved per layer.
        graphdef, weights = nnx.split(block)
        block = nnx.merge(graphdef, block_in_default_layout(weights))  # no stacked copy in a gather's layout (layouts.py)
        return block(x, positions, segments)

    body = _remat(layer, remat)

    @nnx.scan(in_axes=(nnx.Carry, 0, None if is_layer_L is None else 0, None, None), out_axes=(nnx.Carry, 0),
              transform_metadata=LAYERS_AXIS_METADATA)
    def step(x, block, is_layer, positions, segments):
        x = checkpoint_name(x, LAYER_INPUT)  # what a pipeline tick's remat policy keeps (parallel/pipeline.py)
        y, stats = body(block, x, positions, segments)
        return (y if is_layer is None else jnp.where(is_layer, y, x)), stats

    return step(x_BxLxD, blocks, is_layer_L, positions_BxL, segment_ids_BxL)


def _decode_stack(blocks, x_BxSxD, positions_BxS, cache_Lx):
    """The stacked blocks in order over their stacked caches [layers, ...]: (output, the updated caches)."""

    @nnx.scan(in_axes=(nnx.Carry, 0, 0, None), out_axes=(nnx.Carry, 0), transform_metadata=LAYERS_AXIS_METADATA)
    def step(x, block, cache, positions):
        return block.decode(x, positions, cache)

    return step(x_BxSxD, blocks, cache_Lx, positions_BxS)
