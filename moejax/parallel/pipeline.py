"""Circular (interleaved) pipeline schedule over a mesh axis, written for GSPMD (MaxText's design): every array
of the schedule has a leading stage dim split over the stage axis, each `lax.scan` tick runs the stage function
under `jax.vmap(spmd_axis_name=axis)` (each device computes its own stage), and `jnp.roll` along the stage dim
hands activations to the next stage (XLA: a collective-permute).

Layers are split into S stages x V virtual stages (repeats): chunk k = r * S + s (stage s, repeat r) holds the
next layers in layer order, so stage s holds V chunks and a micro-batch goes round the ring of stages V times
(MaxText's circular pipeline; Megatron's interleaved
schedule places chunks the same way). With M micro-batches, stage s works at tick t on item i = t - s: repeat
i // M, micro-batch i % M; the schedule has M x V + S - 1 ticks, of which each stage idles S - 1 (the bubble,
(S - 1) / (M x V) of the useful ticks). The last stage's output of repeat r < V - 1 arrives at stage 0 before
stage 0 needs it (M >= S) and waits in a buffer of M slots until its turn.

Uneven splits (L not a multiple of S x V, e.g. DeepSeek-V3's 58 MoE layers on the record's PP2 x VP8): every chunk has
C = ceil(L / (S V)) layer slots, the first L - (C - 1) S V chunks hold C layers and the others C - 1, followed by one
identity slot (`layer_slots`). Every stage runs C slots per tick in lockstep, identity slots included: the cost of
an uneven split is the S V C / L of MoE-layer compute a padded chunk takes (Megatron's uneven stages idle the same
time on the shorter stages).

Every other mesh axis stays automatic inside (GSPMD splits what the stage function does over data, fsdp, expert
and tensor), and a `jax.shard_map` over the whole mesh inside the stage function (the MoE dispatch) is batched by
vmap with the stage axis added to its specs. Why not a shard_map manual over the stage axis with ppermute: in
jax 0.10 and 0.12, differentiating a shard_map nested in one that is manual over another axis gives the inner
one's residuals specs naming the outer axis, which does not lower (sdy: "operates on axis 'stage' which is
already bound by a parent"). Autodiff goes through the scan: the backward is the ring run in reverse.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P


def schedule_ticks(n_stages: int, n_micro: int, n_repeats: int) -> int:
    """Ticks of the circular schedule: every stage does n_micro x n_repeats items and starts one tick after the
    stage before it."""
    return n_micro * n_repeats + n_stages - 1


def bubble_fraction(n_stages: int, n_micro: int, n_repeats: int) -> float:
    """Idle ticks over useful ticks per stage, (S - 1) / (M x V)."""
    return (n_stages - 1) / (n_micro * n_repeats)


def check_schedule(n_layers: int, n_stages: int, n_repeats: int, n_micro: int) -> int:
    """Layer slots per chunk (C = ceil(L / (S V))); ValueError (one line, what to change) when the layers or the
    micro-batch count cannot run the schedule."""
    chunks = n_stages * n_repeats
    if n_layers < chunks:
        raise ValueError(f"{n_layers} layers are fewer than {n_stages} stages x {n_repeats} virtual stages = {chunks} "
                         f"chunks: every chunk needs a layer; choose stages x virtual stages <= {n_layers}")
    if n_micro < n_stages:
        raise ValueError(f"{n_micro} micro-batches are fewer than {n_stages} pipeline stages: the circular schedule "
                         f"needs train.micro_batches >= stages")
    return chunk_slots(n_layers, n_stages, n_repeats)


def chunk_slots(n_layers: int, n_stages: int, n_repeats: int) -> int:
    """C: layer slots per chunk, ceil(L / (S V)) (each stage runs C layers per tick)."""
    return -(-n_layers // (n_stages * n_repeats))


def layer_slots(n_layers: int, n_stages: int, n_repeats: int) -> np.ndarray:
    """[L] int: the slot of each layer in the padded chunk order [V, S, C] flattened (slot (r S + s) C + j). The
    first L - (C - 1) S V chunks hold C layers, the rest C - 1 and an identity slot last; an even split is arange(L)."""
    chunks = n_stages * n_repeats
    per = chunk_slots(n_layers, n_stages, n_repeats)
    full = n_layers - (per - 1) * chunks  # chunks with C layers
    return np.concatenate([k * per + np.arange(per if k < full else per - 1) for k in range(chunks)]).astype(np.int32)


def slot_is_layer(n_layers: int, n_stages: int, n_repeats: int) -> np.ndarray:
    """[V, S, C] bool: which slots hold a layer (False: an identity slot of an uneven split)."""
    per = chunk_slots(n_layers, n_stages, n_repeats)
    mask = np.zeros(n_repeats * n_stages * per, bool)
    mask[layer_slots(n_layers, n_stages, n_repeats)] = True
    return mask.reshape(n_repeats, n_stages, per)


def to_chunks(tree, n_stages: int, n_repeats: int):
    """Layer-stacked leaves [L, ...] -> [V, S, L / (S V), ...] (layer l = (r S + s) per_chunk + j)."""
    return jax.tree.map(lambda a: a.reshape(n_repeats, n_stages, a.shape[0] // (n_stages * n_repeats),
                                            *a.shape[1:]), tree)


def from_chunks(tree):
    """[V, S, per_chunk, ...] -> [L, ...] in layer order (the inverse of to_chunks)."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1] * a.shape[2], *a.shape[3:]), tree)


def circular_pipeline(stage_fn: Callable, params_VxSxC, x_MxB, *, mesh, axis: str, n_repeats: int, side_MxB=None,
                      aux_like=None, tick_policy=None):
    """Run `stage_fn(chunk_params, x_B, side_B) -> (y_B, aux)` over every chunk of layers for every micro-batch.

    params_VxSxC: a tree of [V, S, per_chunk, ...] leaves (to_chunks of the layer stack); x_MxB: [M, ...]
    micro-batches of activations; side_MxB: a tree of per-micro-batch inputs each stage reads for the micro-batch it
    works on (positions, segment ids) or None; aux: a tree of per-chunk outputs kept per micro-batch (e.g. MoE
    statistics per layer), `aux_like` one chunk's (shapes and dtypes) or None. Returns (y_MxB: the last chunk's
    outputs, aux_VxSxMx...: each chunk's aux for each micro-batch, or None). Equal to applying the chunks in layer
    order to each micro-batch.

    Memory: with one repeat the chunk of weights is loop-invariant and the backward reads the weights themselves;
    with virtual stages it is selected per tick, and the scan would save a copy for every tick (about M copies of
    the stage's weights). `tick_policy`, a jax.checkpoint policy for the tick, avoids that: one that saves what
    the stage function's own remat keeps (e.g. its layers' inputs, by name) lets the backward re-select the
    weights instead (MaxText's remat of pipeline iterations).
    """
    n_stages = mesh.shape[axis]
    n_micro = x_MxB.shape[0]
    if n_micro < n_stages:
        raise ValueError(f"{n_micro} micro-batches are fewer than {n_stages} pipeline stages")
    n_items = n_micro * n_repeats
    stage_S = jnp.arange(n_stages, dtype=jnp.int32)
    with_aux = aux_like is not None
    by_stage = functools.partial(jax.vmap, spmd_axis_name=axis)

    def split(a, dim=0):
        """Stage dim `dim` over the stage axis, the others left to GSPMD."""
        spec = [P.UNCONSTRAINED] * a.ndim
        spec[dim] = axis
        return lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

    def keep(acc_VxM, a, r, m, busy):
        """acc[r, m] = a on a busy tick (each (repeat, micro-batch) comes once per stage)."""
        row_M = _index(acc_VxM, r)
        row_M = jnp.where(busy, lax.dynamic_update_index_in_dim(row_M, a, m, 0), row_M)
        return lax.dynamic_update_index_in_dim(acc_VxM, row_M, r, 0)

    def enter(state_B, wait_MxB, x_MxB_s, first, repeat, micro, t):
        """One stage's input at tick t. On stage 0 (`first`) what the last stage finished one tick ago (rolled in
        as state_B, item t - S) parks in the stage's own wait buffer until its next repeat, and the input is a fresh
        micro-batch on the first repeat, else that micro-batch's parked output; elsewhere the rolled-in state."""
        back = t - n_stages
        parks = first & (back >= 0) & (back < n_items - n_micro)
        wait_MxB = jnp.where(parks, lax.dynamic_update_index_in_dim(wait_MxB, state_B, back % n_micro, 0), wait_MxB)
        first_B = jnp.where(repeat == 0, _index(x_MxB_s, micro), _index(wait_MxB, micro))
        return jnp.where(first, first_B, state_B), wait_MxB

    def leave(out_MxB, y_B, last, busy, repeat, micro):
        """The last stage keeps a micro-batch's output of its last repeat in its own output buffer."""
        done = last & busy & (repeat == n_repeats - 1)
        return jnp.where(done, lax.dynamic_update_index_in_dim(out_MxB, y_B, micro, 0), out_MxB)

    def tick(carry, t):
        state_SxB, wait_SxM, out_SxM, aux_VxS = carry
        item_S = t - stage_S
        busy_S = (item_S >= 0) & (item_S < n_items)
        item_S = jnp.clip(item_S, 0, n_items - 1)
        repeat_S, micro_S = item_S // n_micro, item_S % n_micro
        # Every buffer has a leading stage dim split over the stage axis and each stage touches only its own row:
        # no value crosses stages inside a tick except the roll below (a collective-permute).
        in_SxB, wait_SxM = by_stage(enter, in_axes=(0, 0, 0, 0, 0, 0, None))(
            state_SxB, wait_SxM, x_SxM, stage_S == 0, repeat_S, micro_S, t)
        in_SxB = split(in_SxB)
        if n_repeats == 1:  # loop-invariant: the backward reads the weights instead of a copy saved per tick
            chunk_SxC = jax.tree.map(lambda a: a[0], params_VxSxC)
        else:
            chunk_SxC = by_stage(lambda p_VxC, r: jax.tree.map(lambda a: _index(a, r), p_VxC), in_axes=(1, 0))(
                params_VxSxC, repeat_S)
        side_SxB = jax.tree.map(lambda a: split(a[micro_S]), side_MxB)
        y_SxB, aux_S = by_stage(stage_fn)(chunk_SxC, in_SxB, side_SxB)
        y_SxB = split(y_SxB)
        out_SxM = by_stage(leave)(out_SxM, y_SxB, stage_S == n_stages - 1, busy_S, repeat_S, micro_S)
        if with_aux:
            aux_VxS = jax.tree.map(lambda acc, a: by_stage(keep, in_axes=(1, 0, 0, 0, 0), out_axes=1)(
                acc, a, repeat_S, micro_S, busy_S), aux_VxS, aux_S)
        return (split(jnp.roll(y_SxB, 1, axis=0)), split(wait_SxM), split(out_SxM), aux_VxS), None

    def per_stage(a_MxB):
        """[M, ...] -> [S, M, ...] split over the stage axis: a copy per stage (each device keeps its own)."""
        return split(jnp.broadcast_to(a_MxB[None], (n_stages, *a_MxB.shape)))

    state_SxB = split(jnp.zeros((n_stages, *x_MxB.shape[1:]), x_MxB.dtype))
    x_SxM = per_stage(x_MxB)  # read by stage 0 only; its cotangent is summed over the stages once, after the scan
    aux_VxS = jax.tree.map(lambda a: jnp.zeros((n_repeats, n_stages, n_micro, *a.shape), a.dtype), aux_like)
    init = (state_SxB, per_stage(jnp.zeros_like(x_MxB)), per_stage(jnp.zeros_like(x_MxB)), aux_VxS)
    ticks = jnp.arange(schedule_ticks(n_stages, n_micro, n_repeats), dtype=jnp.int32)
    if tick_policy is not None:
        tick = jax.checkpoint(tick, policy=tick_policy, prevent_cse=False)
    (_, _, out_SxM, aux_VxS), _ = lax.scan(tick, init, ticks)
    # The last stage's outputs, to every stage (one transfer per step, not one per tick).
    out_MxB = out_SxM[n_stages - 1]
    return out_MxB, (aux_VxS if with_aux else None)


def describe_split(n_layers: int, n_stages: int, n_repeats: int, n_micro: int) -> str:
    """One line for the run's banner: the split, its identity slots' extra compute, the bubble."""
    per = chunk_slots(n_layers, n_stages, n_repeats)
    slots = per * n_stages * n_repeats
    pad = (f"{slots - n_layers} identity slots: MoE-layer compute x{slots / n_layers:.3f}" if slots > n_layers
           else "even split")
    return (f"pipeline {n_stages} stages x {n_repeats} virtual: {n_layers} MoE layers in {n_stages * n_repeats} "
            f"chunks of {per} slots ({pad}), bubble {bubble_fraction(n_stages, n_micro, n_repeats):.1%}")


def micro_batches(x_BxN, n: int):
    """[B, ...] -> [n, B/n, ...], micro-batch m = rows m, m + n, m + 2n, ...: with the batch dim split in contiguous
    blocks over devices (and n dividing each block), every micro-batch keeps an equal share on every device, so
    slicing one out moves no data."""
    return None if x_BxN is None else x_BxN.reshape(x_BxN.shape[0] // n, n, *x_BxN.shape[1:]).swapaxes(0, 1)


def merge_micro_batches(x_MxBxN):
    """The inverse of micro_batches: [n, B/n, ...] -> [B, ...] in the original row order."""
    return x_MxBxN.swapaxes(0, 1).reshape(x_MxBxN.shape[0] * x_MxBxN.shape[1], *x_MxBxN.shape[2:])


def _index(a, i):
    return lax.dynamic_index_in_dim(a, i, 0, keepdims=False)
