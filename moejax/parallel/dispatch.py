"""Expert dispatch and combine inside `jax.shard_map`, selected by `moe.dispatch`.

Tokens are split over every batch axis, experts over `expert` (ep devices, E/ep local experts each).

  capacity   each device ranks its assignments per expert (routing_plan.py; 'position' or 'probability'
             drop policy) into a [E*C, D] expert-major buffer, which is therefore sorted by destination
             device; all_to_all over `expert`; the local experts run as one grouped matmul over
             [E_local, ep*C, D]; all_to_all back; combine. C = ceil(capacity_factor * T*K / E).
  allgather  all-gather tokens and routing over `expert`; each device runs its local experts on every
             gathered token routed to them (capacity over the gathered tokens); reduce-scatter the
             partial outputs back. Better for small expert groups or large top-k.
  dropless   never drops (dropless.py): exchange int32 per-expert counts, then move exactly the routed rows
             with `lax.ragged_all_to_all` (emulated on CPU) in rounds of a static receive window
             (`moe.dropless_window` x the balanced load); steps whose largest load exceeds the window run
             overflow rounds, so buffers follow the window and compute the load.

Dispatch and combine are gathers through both directions of one permutation (routing_plan.py), also in
the backward pass. Without a mesh (single-device reference runs) the same code runs with ep=1 and no
collectives.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.kernels import grouped_gemm
from moejax.parallel import dropless
from moejax.parallel.mesh import EXPERT_AXIS, FFN_AXIS, FSDP_AXIS, current_mesh, inside_pipeline_stage, token_axes
from moejax.parallel.routing_plan import combine_rows, dispatch_rows, make_plan
from moejax.remat_names import EXPERT_EXCHANGE


class DispatchStats(NamedTuple):
    # int32, summed over the whole mesh: f32 sums are exact only to 2^24, a DeepSeek-V3 step has ~1.3e8 assignments
    tokens_per_expert_E: jax.Array  # assignments routed to each expert
    dropped: jax.Array  # assignments dropped for capacity (dropless: 0)
    assignments: jax.Array  # tokens * top_k
    rounds: jax.Array  # dropless rounds this step ran (the same on every device); 1 in the other modes


def capacity_per_expert(tokens_per_device: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert for `tokens_per_device` tokens. capacity_factor <= 0: worst case, nothing drops.

    Tokens choose an expert at most once each, so `tokens_per_device` slots never drop.
    """
    if capacity_factor <= 0:
        return tokens_per_device
    balanced = tokens_per_device * top_k / n_experts
    return max(1, min(tokens_per_device, math.ceil(capacity_factor * balanced)))


def _buffer_rows(mode, tokens_per_device, top_k, n_experts, ep, capacity_factor, dropless_window, gemm) -> int:
    """Per-expert slots (capacity, allgather) or the rows of one round's receive window (dropless)."""
    if mode == "dropless":
        return dropless.window_rows(tokens_per_device, top_k, ep, n_experts // ep, dropless_window,
                                    grouped_gemm.row_multiple(gemm))
    # allgather: each expert sees the tokens of its whole expert group.
    seen = tokens_per_device * ep if mode == "allgather" else tokens_per_device
    capacity = capacity_per_expert(seen, top_k, n_experts, capacity_factor)
    if gemm == "te":  # each expert's slots a whole number of Transformer Engine's row groups (more slots, no copy)
        return -(-capacity // grouped_gemm.row_multiple(gemm)) * grouped_gemm.row_multiple(gemm)
    return capacity


def _plan(expert_idx_TxK, expert_w_TxK, n_experts, capacity, drop_policy):
    priority = expert_w_TxK.reshape(-1) if drop_policy == "probability" else None
    return make_plan(expert_idx_TxK.reshape(-1), n_experts, capacity, priority)


def _stats(counts_E, dropped, assignments, collective: bool, rounds=1) -> DispatchStats:
    counts_E, dropped, assignments = counts_E.astype(jnp.int32), dropped.astype(jnp.int32), jnp.int32(assignments)
    if collective:
        counts_E, dropped, assignments = jax.lax.psum((counts_E, dropped, assignments), token_axes())
    return DispatchStats(counts_E, dropped, assignments, jnp.asarray(rounds, jnp.int32))


def slot_chunks(capacity: int, chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) slot ranges of each expert's capacity, one per exchange (moe.exchange_chunks): as even as the
    capacity allows, never empty (at most `capacity` chunks)."""
    n = max(1, min(chunks, capacity))
    bounds = [capacity * i // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _capacity_chunk(buf_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, ep, gemm, ffn_axis):
    """Slots [E, c, D] of every expert (expert-major, so sorted by destination device) through their experts and
    back: all_to_all over `expert`, the local experts as one grouped matmul over [E_local, ep*c, D], all_to_all
    back."""
    n_experts, cap, d_model = buf_ExCxD.shape
    n_local = n_experts // ep
    if ep > 1:
        # [dest device, E_local*c, D] -> [source device, E_local*c, D]
        buf_PxRxD = jax.lax.all_to_all(buf_ExCxD.reshape(ep, n_local * cap, d_model), EXPERT_AXIS, 0, 0)
        x_ExCxD = buf_PxRxD.reshape(ep, n_local, cap, d_model).transpose(1, 0, 2, 3)
        x_ExCxD = checkpoint_name(x_ExCxD.reshape(n_local, ep * cap, d_model), EXPERT_EXCHANGE)
    else:
        x_ExCxD = buf_ExCxD
    y_ExCxD = grouped_gemm.expert_ffn(x_ExCxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, kernel=gemm, ffn_axis=ffn_axis)
    if ep > 1:
        y_PxRxD = y_ExCxD.reshape(n_local, ep, cap, d_model).transpose(1, 0, 2, 3)
        y_PxRxD = jax.lax.all_to_all(y_PxRxD.reshape(ep, n_local * cap, d_model), EXPERT_AXIS, 0, 0)
        y_ExCxD = checkpoint_name(y_PxRxD.reshape(n_experts, cap, d_model), EXPERT_EXCHANGE)
    return y_ExCxD


def _capacity_moe(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, ffn_axis,
                  n_experts, ep, capacity, gemm, drop_policy, collective, chunks=1):
    """chunks (moe.exchange_chunks): each expert's slots split into that many ranges, each exchanged and computed
    on its own (_capacity_chunk): independent, so XLA's scheduler can run one range's all_to_all under another's
    GEMMs. Every slot meets the same expert, so the result is the unchunked layer's."""
    n_tokens, top_k = expert_idx_TxK.shape
    d_model = x_TxD.shape[-1]
    plan = _plan(expert_idx_TxK, expert_w_TxK, n_experts, capacity, drop_policy)
    buf_ExCxD = dispatch_rows(x_TxD, plan.slot_A, plan.src_S, top_k).reshape(n_experts, capacity, d_model)
    y_parts = [_capacity_chunk(buf_ExCxD[:, lo:hi], w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, ep=ep, gemm=gemm,
                               ffn_axis=ffn_axis) for lo, hi in slot_chunks(capacity, chunks)]
    y_ExCxD = y_parts[0] if len(y_parts) == 1 else jnp.concatenate(y_parts, axis=1)
    y_SxD = y_ExCxD.reshape(n_experts * capacity, d_model)
    out_TxD = combine_rows(y_SxD, expert_w_TxK, plan.slot_A, plan.src_S)
    dropped = jnp.sum(~plan.keep_A)
    return out_TxD, _stats(plan.counts_E, dropped, n_tokens * top_k, collective)


def _allgather_moe(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, ffn_axis,
                   n_experts, ep, capacity, gemm, drop_policy, collective, chunks=1):
    """chunks: one exchange always (config validation refuses moe.exchange_chunks > 1 with allgather)."""
    n_tokens, top_k = expert_idx_TxK.shape
    n_local = n_experts // ep
    if ep > 1:
        x_all = jax.lax.all_gather(x_TxD, EXPERT_AXIS, tiled=True)
        idx_all = jax.lax.all_gather(expert_idx_TxK, EXPERT_AXIS, tiled=True)
        w_all = jax.lax.all_gather(expert_w_TxK, EXPERT_AXIS, tiled=True)
        first_local = jax.lax.axis_index(EXPERT_AXIS) * n_local
    else:
        x_all, idx_all, w_all, first_local = x_TxD, expert_idx_TxK, expert_w_TxK, 0
    # Assignments to other devices' experts go to a virtual expert n_local whose slots do not exist.
    local_idx = idx_all - first_local
    is_local = (local_idx >= 0) & (local_idx < n_local)
    plan = _plan(jnp.where(is_local, local_idx, n_local), w_all, n_local + 1, capacity, drop_policy)
    n_slots = n_local * capacity
    slot_A = jnp.where(plan.slot_A < n_slots, plan.slot_A, n_slots)
    src_S = plan.src_S[:n_slots]
    buf_SxD = dispatch_rows(x_all, slot_A, src_S, top_k)
    y_ExCxD = grouped_gemm.expert_ffn(buf_SxD.reshape(n_local, capacity, -1), w_gate_ExDxF, w_up_ExDxF,
                                      w_down_ExFxD, kernel=gemm, ffn_axis=ffn_axis)
    partial_out = combine_rows(y_ExCxD.reshape(n_slots, -1), w_all, slot_A, src_S)
    out_TxD = jax.lax.psum_scatter(partial_out, EXPERT_AXIS, scatter_dimension=0, tiled=True) if ep > 1 else partial_out
    # Every device counts drops among the gathered assignments to its own experts: summed over the
    # mesh that is each dropped assignment once. Loads come from the device's own tokens.
    dropped = jnp.sum(is_local.reshape(-1) & ~plan.keep_A)
    counts_E = jnp.bincount(expert_idx_TxK.reshape(-1), length=n_experts)
    return out_TxD, _stats(counts_E, dropped, n_tokens * top_k, collective)


def _dropless_moe(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, ffn_axis,
                  n_experts, ep, capacity, gemm, drop_policy, collective, chunks=1):
    """dropless.py; `capacity` here is the window: rows received per round."""
    out_TxD, counts_E, rounds = dropless.dropless_moe(
        x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, n_experts=n_experts, ep=ep,
        window=capacity, gemm=gemm, ffn_axis=ffn_axis, collective=collective, chunks=chunks)
    return out_TxD, _stats(counts_E, jnp.int32(0), expert_idx_TxK.size, collective, rounds)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _weights_for_compute(w_shard, d_model_dim: int, dtype, f32_grad: bool, replicas: tuple[str, ...], fsdp: int,
                         typed: bool):
    """Inside the dispatch shard_map: this device's expert weights cast to the compute dtype, then all-gathered
    over fsdp (stored split on d_model): the gather moves compute-dtype bytes. replicas: the batch axes of size > 1
    the weights are replicated over (data; `stage` too outside pipeline stages); fsdp: that axis' size (no gather
    over an fsdp axis of size 1: XLA:CPU would keep a trivial one).

    Backward (the mixed-precision contract): the weight gradient is summed over the replica axes and
    reduce-scattered over fsdp in f32 (f32_grad) - autodiff would do both in the compute dtype, at the shard_map
    boundary. The output is marked varying over the replica axes so no implicit (compute-dtype) reduction is left
    for shard_map to insert. typed=False (a shard_map with check_vma=False, _untyped_dispatch): shard_map's
    transpose itself sums the weights' cotangent over the axes their in_spec does not name (the replicas), on
    the cotangent as returned here, in the parameter dtype (f32 for f32 parameters), so it is not summed here a
    second time.
    """
    w = w_shard.astype(dtype)
    if fsdp > 1:
        w = jax.lax.all_gather(w, FSDP_AXIS, axis=d_model_dim, tiled=True)
    # The in_spec does not split the weights over the replica axes (invariant there); all_gather leaves them
    # varying over fsdp.
    # Over axes of size 1 there is nothing to sum: shard_map's own (compute-dtype) pvary/psum pair is a no-op.
    return jax.lax.pcast(w, replicas, to="varying") if replicas else w


def _weights_fwd(w_shard, d_model_dim, dtype, f32_grad, replicas, fsdp, typed):
    return (_weights_for_compute(w_shard, d_model_dim, dtype, f32_grad, replicas, fsdp, typed),
            jnp.zeros((0,), w_shard.dtype))


def _weights_bwd(d_model_dim, dtype, f32_grad, replicas, fsdp, typed, param_dtype_0, grad_w):
    grad_w = grad_w.astype(jnp.float32 if f32_grad else dtype)
    if replicas and typed:
        grad_w = jax.lax.psum(grad_w, replicas)
    if fsdp > 1:
        grad_w = jax.lax.psum_scatter(grad_w, FSDP_AXIS, scatter_dimension=d_model_dim, tiled=True)
    return (grad_w.astype(param_dtype_0.dtype),)


_weights_for_compute.defvjp(_weights_fwd, _weights_bwd)


def _untyped_dispatch(mesh, mode: str, gemm: str) -> bool:
    """Whether the dispatch shard_map runs with check_vma=False (no varying-axis types; every sum explicit):
    - with tokamax's grouped GEMM: its Blackwell kernels are Pallas mpmd_maps, which refuse inputs typed as
      varying over a mesh axis ("mpmd_map does not support Refs with varying manual axis types"); every array
      inside the dispatch is. One path for tokamax on every GPU, so Hopper runs the same program shape.
    - with Transformer Engine's grouped GEMM: its primitives' abstract evaluation drops the varying-axis types.
    - dropless inside pipeline stages (dropless._count_at_most: jax mis-types varying axes under the stages' vmap).
    The dispatch code types nothing it relies on: its collectives are explicit, the custom VJPs' varying marks are
    no-ops untyped, and _weights_for_compute leaves the replica sum to shard_map's transpose."""
    return gemm in ("tokamax", "te") or (mode == "dropless" and inside_pipeline_stage(mesh))


_MODES = {"capacity": _capacity_moe, "allgather": _allgather_moe, "dropless": _dropless_moe}


def routed_experts(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
                   capacity_factor: float, mode: str = "capacity", drop_policy: str = "position",
                   gemm: str = "einsum", dropless_window: float = 1.25, compute_dtype=None, f32_grad: bool = True,
                   exchange_chunks: int = 1):
    """Routed-expert output [T, D] for tokens x [T, D] and their top-k experts/weights [T, K]. The expert weights
    come as stored (param dtype) and are cast to compute_dtype (default: x's) where they are used.
    exchange_chunks: exchanges per layer and direction (capacity, dropless), resolved (moe.exchange_chunks)."""
    dtype = jnp.dtype(compute_dtype or x_TxD.dtype)
    n_experts = w_gate_ExDxF.shape[0]
    top_k = expert_idx_TxK.shape[-1]
    body_fn = _MODES[mode]
    mesh = current_mesh()
    if mesh is None:
        capacity = _buffer_rows(mode, x_TxD.shape[0], top_k, n_experts, 1, capacity_factor, dropless_window, gemm)
        w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD = (w.astype(dtype) for w in (w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD))
        return body_fn(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD,
                       n_experts=n_experts, ep=1, capacity=capacity, gemm=gemm, drop_policy=drop_policy,
                       collective=False, ffn_axis=None, chunks=exchange_chunks)

    ep = mesh.shape[EXPERT_AXIS]
    batch_shards = math.prod(mesh.shape[a] for a in token_axes())
    if x_TxD.shape[0] % batch_shards:
        raise ValueError(f"{x_TxD.shape[0]} tokens do not split over {batch_shards} batch shards")
    capacity = _buffer_rows(mode, x_TxD.shape[0] // batch_shards, top_k, n_experts, ep, capacity_factor,
                            dropless_window, gemm)
    tokens = P(token_axes(), None)
    # Expert weights enter as stored: split over `expert`, over fsdp on d_model, and over the tensor axis on the
    # FFN dim; inside, they are cast and all-gathered over fsdp (_weights_for_compute). Tokens are replicated over
    # tensor, so each tensor rank computes its FFN slice and the down projection is psum'd over tensor.
    ffn_axis = FFN_AXIS if mesh.shape[FFN_AXIS] > 1 else None
    w_in = P(EXPERT_AXIS, FSDP_AXIS, ffn_axis)  # gate, up: [E, D, F]
    w_out = P(EXPERT_AXIS, ffn_axis, FSDP_AXIS)  # down: [E, F, D]
    stats_spec = DispatchStats(P(), P(), P(), P())
    replicas = tuple(a for a in token_axes() if a not in (EXPERT_AXIS, FSDP_AXIS) and mesh.shape[a] > 1)
    fsdp = mesh.shape[FSDP_AXIS]

    typed = not _untyped_dispatch(mesh, mode, gemm)

    def body(x, idx, w, w_gate, w_up, w_down):
        w_gate, w_up = (_weights_for_compute(w_, 1, dtype, f32_grad, replicas, fsdp, typed) for w_ in (w_gate, w_up))
        w_down = _weights_for_compute(w_down, 2, dtype, f32_grad, replicas, fsdp, typed)
        return body_fn(x, idx, w, w_gate, w_up, w_down, n_experts=n_experts, ep=ep, capacity=capacity, gemm=gemm,
                       drop_policy=drop_policy, collective=True, ffn_axis=ffn_axis, chunks=exchange_chunks)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
        out_specs=(tokens, stats_spec), check_vma=typed,
    )(x_TxD, expert_idx_TxK, expert_w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
